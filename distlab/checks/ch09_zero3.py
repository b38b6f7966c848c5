"""Lab 9's tasks 3 and 4 (the table is `distlab.checks.ch09`'s): the learner's ZeRO-3 on real text draws one
process's curve (`zero3_curve`), and a run saved, thrown away and loaded continues it bit for bit (`resume`).
`GradingZeRO3` is the ZeRO-3 `distlab grade` gives lab 9's answer cells (see ch09's docstring).
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
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import expect


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


CURVE_SEED, RESUME_SEED = 11, 23   # the notebook's fixed inputs


def zero3_curve_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    from distlab.checks.draws import draw_seed
    return _draw(draw_seed(rng) % 2**31, case.world_size, CURVE_STEPS)


def zero3_curve_exercise(case: Case, train_steps: Any, ZeRO3: Any, inputs: dict | None = None) -> dict:
    mine = _mine(inputs, CURVE_STEPS, CURVE_SEED)
    zero = _zero(ZeRO3, mine, "w.")
    distlab.engine.runtime.progress(f"your train_steps, {CURVE_STEPS} steps")
    losses = train_steps(zero, _batches(mine, range(CURVE_STEPS)))
    return {"losses": [float(v) for v in losses]}


def zero3_curve_reference(case: Case, inputs: list | None = None) -> list[float]:
    from distlab.checks.task import on_one_rank
    whole = inputs if inputs is not None else _draw(CURVE_SEED, case.world_size, CURVE_STEPS)
    return on_one_rank(_one_process, whole, CURVE_STEPS)


def zero3_curve_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
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


def resume_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    from distlab.checks.draws import draw_seed
    return _draw(draw_seed(rng) % 2**31, case.world_size, RESUME_STEPS)


def resume_exercise(case: Case, save_state: Any, load_state: Any, ZeRO3: Any, inputs: dict | None = None
                ) -> dict:
    r, dev = distlab.rank(), distlab.device()
    mine = _mine(inputs, RESUME_STEPS, RESUME_SEED)
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


def resume_reference(case: Case, inputs: list | None = None) -> list[float]:
    """One process's curve: the run that saves must still draw it (saving changes nothing)."""
    from distlab.checks.task import on_one_rank
    whole = inputs if inputs is not None else _draw(RESUME_SEED, case.world_size, RESUME_STEPS)
    return on_one_rank(_one_process, whole, RESUME_STEPS)


def resume_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
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


