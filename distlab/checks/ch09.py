"""Lab 9's graded tasks: the sharded loader, and a ZeRO checkpoint resharded by hand.

1. `loader` — `rank_windows(step, rank, world_size, batch_size, n_windows, seed)`: the window ids rank
   `rank` reads at step `step`. Judged by what makes data-parallel training equal one process and a
   resume possible, not by one particular order: on 4 ranks no window is read twice within an epoch and
   every window is read once per epoch (disjoint, complete), each epoch in a new order; the ranks' rows
   put together in rank order give the same global batch on 2 ranks as on 4, and a second call gives the
   same rows (resumable: the position is the step alone, at any world size).
2. `checkpoint` — `save_shard(ckpt_dir, shard, numel)` and `load_shard(ckpt_dir, rank, world_size)`: a
   ZeRO rank's flat shards (parameters and both AdamW moments of a flat vector of `numel` elements, padded
   to a multiple of N, rank r holding elements [r·s, (r+1)·s), s = ceil(numel / N)), saved by 4 ranks and
   loaded as the shards rank r of 2 and of 3 would hold: the same values as slicing the whole vector.

3. `zero3_curve` — `train_steps(zero, batches)`: a model wrapped in a ZeRO-3 class (`zero.optimizer` steps
   this rank's shards) trained on this rank's rows of each global batch of real text; it returns the global
   loss of each step. Judged against one process training the whole batches with AdamW: the same curve to
   fp32 rounding, the same list on every rank.
4. `resume` — `save_state(ckpt_dir, zero, step)` and `load_state(ckpt_dir, zero) -> step`: a ZeRO-3 run saves
   after step S and keeps training; then everything it held in memory is thrown away (a killed rank loses
   exactly that), a fresh run with other starting weights and a new optimizer loads the checkpoint and
   trains on. Its losses must equal the uninterrupted run's, bit for bit (same ranks, same order of
   additions), from the step it resumes at.

Tasks 3 and 4 take the ZeRO-3 class as an answer: in the notebook the learner's own from lab 5 (the lab's
setup cell loads it); `distlab grade` sees lab 9's answer cells only, so there `ZeRO3` is the PRELUDE's,
`GradingZeRO3`: lab 5's interface over the simplest ZeRO-3 (the whole model as one flat unit; PyTorch's
`fully_shard` was the first choice, but under the grader's audit its first step alone used more than the
case's CPU cap).

Under `distlab grade` the sizes, seeds, the flat state, the starting weights and the text rows are drawn from
a secret seed (`inputs`); each rank receives only its own shard or rows.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import CheckFailed, compare, expect

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import math
import os

import torch
import torch.distributed as dist

import distlab
from distlab.course.models import lm_loss
# `distlab grade` sees this notebook's answer cells only: there your loop runs with the grader's own
# ZeRO-3 (the whole model as one unit, lab 5's interface). Below, the setup puts your lab 5 class in its place.
from distlab.checks.ch09 import GradingZeRO3 as ZeRO3"""

# torch._dynamo: tasks 3 and 4 build AdamW, whose first construction imports it (1-2 s of CPU per rank, many
# times that under the grader's audit hook: past the case's CPU cap); the runner's fork server pays it once.
RANK_IMPORTS = ("torch", "torch.distributed", "cloudpickle", "distlab.engine.runtime", "distlab.meters",
                "distlab.checks", "torch._dynamo", "torch.func")

# The notebook's fixed inputs: n_windows, batch_size, seed, steps (two epochs and a bit).
LOADER = (29, 8, 7, 9)
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
# numel = 1 mod 4: 4 ranks pad 3 elements, so a load that keeps the old padding slices wrongly at N = 2 and 3.
NUMEL, SAVE_N, LOAD_N = 101, 4, (2, 3)


# ---- the loader ---------------------------------------------------------------------------------------------


def loader_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    B = 4 * int(torch.randint(1, 4, (1,), generator=rng))
    W = int(torch.randint(2 * B + 1, 6 * B, (1,), generator=rng))
    params = torch.tensor([W, B, int(torch.randint(0, 2**30, (1,), generator=rng)), 2 * W // B + 2])
    return [{"params": params} for _ in range(case.world_size)]


def loader_exercise(case: Case, fn: Any, inputs: dict | None = None) -> dict:
    W, B, seed, steps = LOADER if inputs is None else [int(v) for v in inputs["params"]]
    r = distlab.rank()
    ids = lambda s, rank, n: torch.as_tensor(fn(s, rank, n, B, W, seed)).long().flatten().cpu()
    out = {"at4": [ids(s, r, 4) for s in range(steps)], "again": [ids(s, r, 4) for s in range(steps)]}
    if r < 2:
        out["at2"] = [ids(s, r, 2) for s in range(steps)]
    return out


def loader_reference(case: Case, inputs: list | None = None) -> tuple[int, int, int]:
    W, B, seed, steps = LOADER if inputs is None else [int(v) for v in inputs[0]["params"]]
    return W, B, steps


def loader_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
    W, B, steps = reference
    split, again = case.lines

    def global_batches(key: str, n: int) -> list[torch.Tensor]:
        return [torch.cat([outputs[r][key][s] for r in range(n)]) for s in range(steps)]

    def disjoint() -> str:
        for s in range(steps):
            for r in range(4):
                got = outputs[r]["at4"][s]
                expect(got.numel() == B // 4, f"step {s}: rank {r} read {got.numel()} windows; each of 4 ranks "
                                              f"reads B/N = {B // 4} of the global batch of {B}")
                expect(bool(((got >= 0) & (got < W)).all()), f"step {s}: rank {r} read a window id outside "
                                                             f"[0, {W})")
        rows = torch.cat(global_batches("at4", 4)).tolist()
        epochs = [rows[e * W:(e + 1) * W] for e in range(len(rows) // W)]
        for e, epoch in enumerate(epochs):
            twice = sorted({w for w in epoch if epoch.count(w) > 1})
            expect(not twice, f"epoch {e}: window(s) {twice[:5]} read more than once (ranks' slices overlap, "
                              "or an epoch repeats windows)")
            expect(sorted(epoch) == list(range(W)), f"epoch {e} missed windows "
                                                    f"{sorted(set(range(W)) - set(epoch))[:5]}")
        expect(len(epochs) < 2 or epochs[0] != epochs[1], "every epoch visits the windows in the same "
                                                          "order: draw a new order per epoch (seed and epoch)")
        return f"{len(epochs)} epochs of {W} windows, each window once per epoch"

    def resumable() -> str:
        at4, at2 = global_batches("at4", 4), global_batches("at2", 2)
        for s in range(steps):
            expect(torch.equal(at4[s], at2[s]), f"step {s}: the global batch on 2 ranks differs from the one on "
                                                "4 ranks: a checkpoint saved on 4 ranks would resume other data")
            for r in range(4):
                expect(torch.equal(outputs[r]["at4"][s], outputs[r]["again"][s]),
                       f"step {s}: rank {r} read other windows when asked again: the rows must depend on "
                       "(step, rank, world_size, batch_size, n_windows, seed) only")
        return "the same global batch at any world size, from the step alone"

    return [check_line(split, disjoint), check_line(again, resumable)]


# ---- the checkpoint ------------------------------------------------------------------------------------------


def _full_state(numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"param": torch.randn(numel, generator=g), "exp_avg": torch.randn(numel, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(numel, generator=g) * 1e-6}


def flat_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` padded with zeros to a multiple of `world_size` (the ZeRO layout)."""
    s = math.ceil(full.numel() / world_size)
    padded = torch.cat([full, full.new_zeros(s * world_size - full.numel())])
    return padded[rank * s:(rank + 1) * s].clone()


def _shards(full: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [{k: flat_shard(v, r, n) for k, v in full.items()} for r in range(n)]


def checkpoint_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    numel = 4 * int(torch.randint(10, 100, (1,), generator=rng)) + 1     # 1 mod 4, as NUMEL
    full = _full_state(numel, int(torch.randint(0, 2**30, (1,), generator=rng)))
    return [{**shard, "numel": torch.tensor(numel)} for shard in _shards(full, case.world_size)]


def checkpoint_exercise(case: Case, save: Any, load: Any, inputs: dict | None = None) -> dict:
    r, dev = distlab.rank(), distlab.device()
    if inputs is None:
        numel, mine = NUMEL, _shards(_full_state(NUMEL, 0), SAVE_N)[r]
    else:
        numel, mine = int(inputs["numel"]), {k: inputs[k] for k in STATE_KEYS}
    # One folder for the four ranks: rank 0 draws its name, a broadcast tells the others.
    nonce = torch.tensor([int.from_bytes(os.urandom(6), "little") if r == 0 else 0], device=dev)
    dist.broadcast(nonce, 0)
    ckpt_dir = os.path.join(tempfile.gettempdir(), f"distlab-ch09-{int(nonce)}")
    try:
        save(ckpt_dir, {k: v.to(dev) for k, v in mine.items()}, numel)
        dist.barrier()
        out = {m: {k: v.detach().cpu() for k, v in load(ckpt_dir, r, m).items()} for m in LOAD_N if r < m}
        dist.barrier()
    finally:
        if r == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    return out


def checkpoint_reference(case: Case, inputs: list | None = None) -> dict[int, list[dict[str, torch.Tensor]]]:
    if inputs is None:
        full = _full_state(NUMEL, 0)
    else:
        numel = int(inputs[0]["numel"])
        full = {k: torch.cat([i[k] for i in inputs])[:numel] for k in STATE_KEYS}
    return {m: _shards(full, m) for m in LOAD_N}


def checkpoint_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
    def loaded_at(m: int) -> Any:
        def check() -> str:
            for r in range(m):
                got = outputs[r][m]
                expect(set(got) == set(STATE_KEYS), f"rank {r} of {m}: load_shard returned {sorted(got)}, "
                                                    f"expected the keys {list(STATE_KEYS)}")
                for k in STATE_KEYS:
                    try:
                        compare(got[k], reference[m][r][k], atol=0, rtol=0, what=f"rank {r} of {m}'s {k}")
                    except CheckFailed as exc:
                        raise CheckFailed(f"{exc} (its shard: elements [{r}·s, {r + 1}·s) of the whole "
                                          f"vector, s = ceil(numel / {m}), zero-padded)")
            return "every rank's parameters and AdamW moments, exact"
        return check
    return [check_line(line, loaded_at(m)) for line, m in zip(case.lines, LOAD_N)]


from distlab.checks.ch09_zero3 import (CURVE_STEPS, HANG, RESUME_STEPS, ZERO_N, GradingZeRO3,  # noqa: F401
                                       resume_exercise, resume_inputs, resume_judge, resume_reference,
                                       zero3_curve_exercise, zero3_curve_inputs, zero3_curve_judge,
                                       zero3_curve_reference)

# ---- the lab's table: what each task takes, its cases and verdict lines, the functions that run and judge ----

TASKS = table(
    task("loader", "rank_windows",
         per_ranks((4,), "loader: disjoint and complete, 4 ranks", "loader: resumable, 4 ranks and 2"),
         inputs=loader_inputs, exercise=loader_exercise, reference=loader_reference, judge=loader_judge),
    task("checkpoint", ("save_shard", "load_shard"),
         per_ranks((SAVE_N,), *(f"checkpoint: saved at N = {SAVE_N}, loaded at N = {m}" for m in LOAD_N)),
         inputs=checkpoint_inputs, exercise=checkpoint_exercise, reference=checkpoint_reference,
         judge=checkpoint_judge,
         hang_hint="save_shard and load_shard read and write files only: they need no collective."),
    task("zero3_curve", ("train_steps", "ZeRO3"),
         per_ranks((ZERO_N,), f"zero3_curve: {CURVE_STEPS} steps on {ZERO_N} ranks match one process"),
         inputs=zero3_curve_inputs, exercise=zero3_curve_exercise, reference=zero3_curve_reference,
         judge=zero3_curve_judge, hang_hint=HANG),
    task("resume", ("save_state", "load_state", "ZeRO3"),
         per_ranks((ZERO_N,), f"resume: load_state returns the step saved, {ZERO_N} ranks",
                   f"resume: the resumed curve equals the uninterrupted one, {ZERO_N} ranks"),
         inputs=resume_inputs, exercise=resume_exercise, reference=resume_reference, judge=resume_judge,
         hang_hint=HANG),
)

grade = grader(TASKS)
