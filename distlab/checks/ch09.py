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
from distlab.checks.task import Case, Line, Task, grader, check_line
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

class LoaderTask(Task):
    name, answers = "loader", ("rank_windows",)

    def cases(self) -> list[Case]:
        return [Case(4, ("loader: disjoint and complete, 4 ranks", "loader: resumable, 4 ranks and 2"))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        B = 4 * int(torch.randint(1, 4, (1,), generator=rng))
        W = int(torch.randint(2 * B + 1, 6 * B, (1,), generator=rng))
        params = torch.tensor([W, B, int(torch.randint(0, 2**30, (1,), generator=rng)), 2 * W // B + 2])
        return [{"params": params} for _ in range(case.world_size)]

    def exercise(self, case: Case, fn: Any, inputs: dict | None = None) -> dict:
        W, B, seed, steps = LOADER if inputs is None else [int(v) for v in inputs["params"]]
        r = distlab.rank()
        ids = lambda s, rank, n: torch.as_tensor(fn(s, rank, n, B, W, seed)).long().flatten().cpu()
        out = {"at4": [ids(s, r, 4) for s in range(steps)], "again": [ids(s, r, 4) for s in range(steps)]}
        if r < 2:
            out["at2"] = [ids(s, r, 2) for s in range(steps)]
        return out

    def reference(self, case: Case, inputs: list | None = None) -> tuple[int, int, int]:
        W, B, seed, steps = LOADER if inputs is None else [int(v) for v in inputs[0]["params"]]
        return W, B, steps

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
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


class CheckpointTask(Task):
    name, answers = "checkpoint", ("save_shard", "load_shard")
    hang_hint = "save_shard and load_shard read and write files only: they need no collective."

    def cases(self) -> list[Case]:
        return [Case(SAVE_N, tuple(f"checkpoint: saved at N = {SAVE_N}, loaded at N = {m}" for m in LOAD_N))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        numel = 4 * int(torch.randint(10, 100, (1,), generator=rng)) + 1     # 1 mod 4, as NUMEL
        full = _full_state(numel, int(torch.randint(0, 2**30, (1,), generator=rng)))
        return [{**shard, "numel": torch.tensor(numel)} for shard in _shards(full, case.world_size)]

    def exercise(self, case: Case, save: Any, load: Any, inputs: dict | None = None) -> dict:
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

    def reference(self, case: Case, inputs: list | None = None) -> dict[int, list[dict[str, torch.Tensor]]]:
        if inputs is None:
            full = _full_state(NUMEL, 0)
        else:
            numel = int(inputs[0]["numel"])
            full = {k: torch.cat([i[k] for i in inputs])[:numel] for k in STATE_KEYS}
        return {m: _shards(full, m) for m in LOAD_N}

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
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


# ---- the learner's ZeRO-3 on real text: one curve, and a resume ----------------------------------------------

# A tiny course GPT (bytes: vocabulary 256), B rows of T tokens of the stdlib's text per step, on N ranks.
MODEL = dict(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2)
BATCH, CURVE_STEPS, RESUME_STEPS, SAVE_AT, ZERO_N, LR = 8, 4, 5, 2, 2, 3e-3
TEXT_BYTES = 200_000          # the corpus's first files (cached after the first call)
CURVE_ATOL = 1e-5             # fp32: the ranks sum the gradients in another order than one process
HANG = ("train_steps, save_state and load_state call no collective except your loss's all_reduce, on every "
        "rank: a rank that skips it leaves the others waiting")


class _GatherShards(torch.autograd.Function):
    """Forward: all-gather the ranks' flat shards into the whole padded vector. Backward: reduce-scatter the
    whole vector's gradient, divided by N: this rank's slice of the mean gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor) -> torch.Tensor:
        whole = shard.new_empty(shard.numel() * dist.get_world_size())
        dist.all_gather_into_tensor(whole, shard.detach().contiguous())
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        mine = grad.new_empty(grad.numel() // dist.get_world_size())
        dist.reduce_scatter_tensor(mine, grad.contiguous())
        return mine / dist.get_world_size()


class GradingZeRO3(torch.nn.Module):
    """Lab 5's `ZeRO3` interface over the simplest ZeRO-3, for `distlab grade` (which sees lab 9's answer cells
    only): `GradingZeRO3(model, optimizer=lambda shards: ...)`; the whole model is one unit whose parameters
    are flattened, padded to a multiple of N and sliced, rank r keeping slice r as `shard`, the one parameter
    its `optimizer` updates. Forward all-gathers the shards and runs the model on views of the whole vector
    (`torch.func.functional_call`); backward reduce-scatters the gradient. Not memory-saving (the model keeps
    its own tensors): it is what lab 9's loop and checkpoint need, not lab 5's answer."""

    def __init__(self, module: torch.nn.Module, *, optimizer: Any = None, **_: Any) -> None:
        super().__init__()
        n, r = dist.get_world_size(), dist.get_rank()
        self.module = module
        self._names = [k for k, _ in module.named_parameters()]
        self._shapes = [p.shape for _, p in module.named_parameters()]
        flat = torch.cat([p.detach().flatten() for _, p in module.named_parameters()])
        self._numel, per = flat.numel(), math.ceil(flat.numel() / n)
        flat = torch.cat([flat, flat.new_zeros(per * n - flat.numel())])
        dist.broadcast(flat, 0)                    # every rank starts from rank 0's weights
        self.shard = torch.nn.Parameter(flat[r * per:(r + 1) * per].clone())
        self.optimizer = optimizer([self.shard]) if optimizer is not None else None

    def forward(self, *args: Any) -> Any:
        from torch.func import functional_call
        whole = _GatherShards.apply(self.shard)[:self._numel]
        views = dict(zip(self._names, (v.view(s) for v, s in zip(whole.split([s.numel() for s in self._shapes]),
                                                                    self._shapes))))
        return functional_call(self.module, views, args)


def _config() -> Any:
    from distlab.course.models import GPTConfig
    return GPTConfig(**MODEL)


def _draw(seed: int, world_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's inputs: the starting weights (`w.`), a second set for a resumed run (`v.`), and its B/N
    rows of each step's global batch (`x{s}`, `y{s}`): windows of the stdlib's text at drawn offsets."""
    from distlab.checks.draws import drawn_weights
    from distlab.course.models import build_model
    from distlab.course.training.corpus import corpus
    text = corpus(TEXT_BYTES).train
    g = torch.Generator().manual_seed(seed)
    weights = {**drawn_weights(build_model(_config(), seed=seed, device="cpu"), "w."),
               **drawn_weights(build_model(_config(), seed=seed + 1, device="cpu"), "v.")}
    out = [dict(weights) for _ in range(world_size)]
    per, T = BATCH // world_size, MODEL["seq_len"]
    for s in range(steps):
        starts = torch.randint(0, text.numel() - T - 1, (BATCH,), generator=g).tolist()
        rows = torch.stack([text[i:i + T + 1] for i in starts]).long()      # slices: no index tensor meets the text
        for r in range(world_size):
            out[r][f"x{s}"], out[r][f"y{s}"] = rows[r * per:(r + 1) * per, :-1], rows[r * per:(r + 1) * per, 1:]
    return out


def _mine(inputs: dict | None, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's inputs: the drawn ones under grading, else the notebook's fixed ones (seed `seed`)."""
    return inputs if inputs is not None else _draw(seed, distlab.world_size(), steps)[distlab.rank()]


def _zero(ZeRO3: Any, mine: dict, prefix: str) -> Any:
    from distlab.checks.draws import load_weights
    from distlab.course.models import build_model
    model = load_weights(build_model(_config(), device=distlab.device()), mine, prefix)
    from distlab.course.training.strategies import adamw
    return ZeRO3(model, optimizer=lambda shards: adamw(shards, LR))


def _batches(mine: dict, steps: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dev = distlab.device()
    return [(mine[f"x{s}"].to(dev), mine[f"y{s}"].to(dev)) for s in steps]


def _one_process(whole: list[dict[str, torch.Tensor]], steps: int) -> list[float]:
    """One process, the whole batches, the same AdamW: the curve every ZeRO-3 run must draw (on one rank)."""
    from distlab.checks.draws import load_weights
    from distlab.course.models import build_model, lm_loss
    from distlab.course.training.strategies import adamw
    model = load_weights(build_model(_config(), device=distlab.device()), whole[0], "w.")
    opt = adamw(model.parameters(), LR)
    out = []
    for s in range(steps):
        x = torch.cat([i[f"x{s}"] for i in whole]).to(distlab.device())
        y = torch.cat([i[f"y{s}"] for i in whole]).to(distlab.device())
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


class Zero3CurveTask(Task):
    name, answers, hang_hint = "zero3_curve", ("train_steps", "ZeRO3"), HANG
    SEED = 11

    def cases(self) -> list[Case]:
        return [Case(ZERO_N, (f"zero3_curve: {CURVE_STEPS} steps on {ZERO_N} ranks match one process",))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        from distlab.checks.draws import draw_seed
        return _draw(draw_seed(rng) % 2**31, case.world_size, CURVE_STEPS)

    def exercise(self, case: Case, train_steps: Any, ZeRO3: Any, inputs: dict | None = None) -> dict:
        mine = _mine(inputs, CURVE_STEPS, self.SEED)
        zero = _zero(ZeRO3, mine, "w.")
        distlab.engine.runtime.progress(f"your train_steps, {CURVE_STEPS} steps")
        losses = train_steps(zero, _batches(mine, range(CURVE_STEPS)))
        return {"losses": [float(v) for v in losses]}

    def reference(self, case: Case, inputs: list | None = None) -> list[float]:
        from distlab.checks.task import on_one_rank
        whole = inputs if inputs is not None else _draw(self.SEED, case.world_size, CURVE_STEPS)
        return on_one_rank(_one_process, whole, CURVE_STEPS)

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
        def curve() -> str:
            got = [o["losses"] for o in outputs]
            for r, losses in enumerate(got):
                expect(len(losses) == CURVE_STEPS, f"rank {r}: train_steps returned {len(losses)} losses for "
                                                   f"{CURVE_STEPS} batches: one per step")
            for r in range(1, len(got)):
                expect(got[r] == got[0], f"rank {r}'s losses {_fmt(got[r][:2])}... differ from rank 0's "
                                         f"{_fmt(got[0][:2])}...: return the loss of the global batch, the mean "
                                         "of the ranks' losses (all_reduce, then / N), the same on every rank")
            worst = max(range(CURVE_STEPS), key=lambda s: abs(got[0][s] - reference[s]))
            d = abs(got[0][worst] - reference[worst])
            first = next(s for s in range(CURVE_STEPS) if abs(got[0][s] - reference[s]) > CURVE_ATOL) \
                if d > CURVE_ATOL else None
            if first == 0:
                expect(False, f"step 0: loss {got[0][0]:.6f}, one process {reference[0]:.6f} on the same weights "
                              "and rows: the first loss is computed before any update, so the loss itself is not the "
                              "whole batch's (each rank's mean loss, averaged over the ranks)")
            if first is not None:
                expect(False, f"step {first}: loss {got[0][first]:.6f}, one process {reference[first]:.6f} "
                              f"(|Δ| = {abs(got[0][first] - reference[first]):.1e} > {CURVE_ATOL:g}); the steps before "
                              "agree, so an update differs: one backward per step, then optimizer.step() and "
                              "optimizer.zero_grad() (gradients left from the step before add to the next)")
            return f"largest |Δloss| vs one process {d:.1e} over {CURVE_STEPS} steps (fp32 rounding)"
        return [check_line(case.lines[0], curve)]


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def _global_loss(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _course_step(zero: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    from distlab.course.models import lm_loss
    loss = lm_loss(zero, x, y)
    loss.backward()
    zero.optimizer.step()
    zero.optimizer.zero_grad(set_to_none=True)
    return _global_loss(loss)


class ResumeTask(Task):
    name, answers, hang_hint = "resume", ("save_state", "load_state", "ZeRO3"), HANG
    SEED = 23

    def cases(self) -> list[Case]:
        return [Case(ZERO_N, (f"resume: load_state returns the step saved, {ZERO_N} ranks",
                              f"resume: the resumed curve equals the uninterrupted one, {ZERO_N} ranks"))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        from distlab.checks.draws import draw_seed
        return _draw(draw_seed(rng) % 2**31, case.world_size, RESUME_STEPS)

    def exercise(self, case: Case, save_state: Any, load_state: Any, ZeRO3: Any, inputs: dict | None = None
                 ) -> dict:
        r, dev = distlab.rank(), distlab.device()
        mine = _mine(inputs, RESUME_STEPS, self.SEED)
        batches = _batches(mine, range(RESUME_STEPS))
        nonce = torch.tensor([int.from_bytes(os.urandom(6), "little") if r == 0 else 0], device=dev)
        dist.broadcast(nonce, 0)                      # one folder for the ranks: rank 0 names it
        ckpt_dir = os.path.join(tempfile.gettempdir(), f"distlab-ch09-resume-{int(nonce)}")
        try:
            # The uninterrupted run: it saves after step SAVE_AT - 1 and trains on to the end.
            zero = _zero(ZeRO3, mine, "w.")
            straight = []
            for s, (x, y) in enumerate(batches):
                distlab.engine.runtime.progress(f"the run that saves, step {s}")
                straight.append(_course_step(zero, x, y))
                if s + 1 == SAVE_AT:
                    save_state(ckpt_dir, zero, SAVE_AT)
            # A killed rank keeps nothing of its memory: drop the run, start another from other weights.
            del zero
            dist.barrier()
            fresh = _zero(ZeRO3, mine, "v.")
            start = load_state(ckpt_dir, fresh)
            start = int(start) if isinstance(start, (int, torch.Tensor)) and not isinstance(start, bool) else -1
            resumed = []
            if start == SAVE_AT:
                for s in range(start, RESUME_STEPS):
                    distlab.engine.runtime.progress(f"the resumed run, step {s}")
                    resumed.append(_course_step(fresh, *batches[s]))
            dist.barrier()
        finally:
            if r == 0:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        return {"start": start, "straight": straight, "resumed": resumed}

    def reference(self, case: Case, inputs: list | None = None) -> list[float]:
        """One process's curve: the run that saves must still draw it (saving changes nothing)."""
        from distlab.checks.task import on_one_rank
        whole = inputs if inputs is not None else _draw(self.SEED, case.world_size, RESUME_STEPS)
        return on_one_rank(_one_process, whole, RESUME_STEPS)

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
        def step() -> str:
            for r, o in enumerate(outputs):
                expect(o["start"] == SAVE_AT, f"rank {r}: load_state returned {o['start']}, but the checkpoint was "
                                              f"saved after {SAVE_AT} steps (save_state(..., step={SAVE_AT})): return "
                                              "the saved step, where the resumed run continues (its loader's position)")
            return f"step {SAVE_AT}, on every rank"

        def curve() -> str:
            for r, o in enumerate(outputs):
                for s, (a, b) in enumerate(zip(o["straight"], reference)):
                    expect(abs(a - b) <= CURVE_ATOL, f"rank {r}, step {s}: the run that saved logged {a:.6f}, one "
                                                     f"process {b:.6f}: save_state must leave the run as it was "
                                                     "(save copies of the tensors; change nothing in the run)")
                expect(o["start"] == SAVE_AT, f"not compared: rank {r}'s load_state returned {o['start']}")
                straight, resumed = o["straight"][SAVE_AT:], o["resumed"]
                for k, (a, b) in enumerate(zip(straight, resumed)):
                    if a == b:
                        continue
                    s = SAVE_AT + k
                    why = ("the first step after loading already differs, before any update: the model's shards "
                           "did not come back (copy the saved values into the optimizer's parameters, in place)"
                           if k == 0 else
                           f"step {SAVE_AT} matched, so the weights came back; the updates after it differ: the "
                           "optimizer's state (AdamW's moments and its step count, optimizer.state_dict()) did not")
                    expect(False, f"rank {r}, step {s}: resumed loss {b:.7f}, uninterrupted {a:.7f} "
                                  f"(|Δ| = {abs(a - b):.1e}): {why}")
            return f"steps {SAVE_AT}..{RESUME_STEPS - 1}, bit for bit on every rank"

        return [check_line(case.lines[0], step), check_line(case.lines[1], curve)]


TASKS = {t.name: t for t in (LoaderTask(), CheckpointTask(), Zero3CurveTask(), ResumeTask())}

grade = grader(TASKS)
