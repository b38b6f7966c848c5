"""Lab 3's fp16 task: dynamic loss scaling, on ranks that each hold a shard of the gradient.

The learner's `LossScaler` has torch.amp.GradScaler's four calls: `scale(loss)`, `step(optimizer)`,
`update()` and `get_scale()`. The check gives every rank its own fp32 master shard (plain SGD on
it) and, at every step, an fp16 forward `(w16 * x16).float().sum()` whose backward runs in fp16: the
gradient is fp16(scale) * x16, so it overflows to inf where |x| * scale > 65504 (and where the scale
itself exceeds fp16's range, everywhere). The fp16 gradient lands, upcast, in the master's `.grad`,
as in the mixed-precision recipe; then `scaler.step(opt)` and `scaler.update()`.

The inputs hold one spike (|x| in the thousands: an overflow at any scale this check reaches) and one
nan, each on one rank only, at steps drawn under grading; the rest overflows only when the scale
outgrows fp16. So a scaler that decides on its own rank's gradients alone skips where the other rank
steps: ZeRO-1's ranks each see only their shard, and the found-inf flag must be all-reduced (as FSDP's
`ShardedGradScaler` does).

The judge replays every step from what the ranks report (the scale each used, the weights after it),
so each verdict names the first step that went wrong and why:

- `skip and unscale`: a step where this rank's gradient was not finite leaves its weights alone; a step
  where no rank overflowed moves them by -lr x grad / scale;
- `scale`: backed off x backoff_factor after an overflow the rank saw, grown x growth_factor after
  growth_interval good steps in a row (the count restarts at each overflow and each growth);
- `ranks agree`: a step where another rank overflowed is skipped here too, and every rank holds the
  same scale at every step.
"""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import CheckFailed, expect

K = 8                       # elements of each rank's shard: tiny, fp16 elementwise ops only (no matmul)
STEPS = 16                  # enough for the scale to reach fp16's ceiling after the two spikes
INIT_SCALE = 2.0 ** 13      # grows 2^13 -> 2^16 in six good steps; fp16(2^16) is inf
GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2
LR = 0.25
SEED = 303                  # the notebook's fixed inputs; `distlab grade` draws its own
FP16_MAX = 65504.0
ARGS = dict(init_scale=INIT_SCALE, growth_factor=GROWTH, backoff_factor=BACKOFF, growth_interval=INTERVAL)

HANG_HINT = ("The scaler hangs when the ranks disagree about a collective: every rank must all-reduce its "
             "found-inf flag in every step(), whether its own gradient overflowed or not.")


def draw(rng: torch.Generator, n: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's inputs: `w` (its fp32 master shard), `x` (STEPS x K, fp16: |x| < 1.9 but for one spike
    of |x| in [3000, 6000) and one nan, each at a drawn step in 1..7 on a drawn rank)."""
    out = [{"w": torch.rand(K, generator=rng) * 2 - 1,
            "x": ((torch.rand(STEPS, K, generator=rng) * 2 - 1) * 1.9)} for _ in range(n)]
    spike, nan = (1 + torch.randperm(7, generator=rng)[:2]).tolist()
    for step, value in ((spike, 3000 + 3000 * torch.rand(1, generator=rng).item()), (nan, float("nan"))):
        r, i = (int(torch.randint(0, m, (1,), generator=rng)) for m in (n, K))
        out[r]["x"][step, i] = value if torch.rand(1, generator=rng).item() < 0.5 else -value
    for d in out:
        d["x"] = d["x"].to(torch.float16)
    return out


def fp16_grad(scale: float, x: torch.Tensor) -> torch.Tensor:
    """The gradient of scale * (w16 * x).float().sum() w.r.t. w16, as fp16 autograd computes it: the
    upstream scale cast to fp16 (inf past 65504), times x in fp16; upcast to fp32 for the master."""
    return (torch.tensor(scale, dtype=torch.float32).to(torch.float16) * x).float()


class ShardSGD:
    """Plain SGD on this rank's shard, with the two things a scaler reads: `param_groups` and `step()`.
    Not a torch.optim.Optimizer: the first step of one imports torch's compiler (seconds on every rank)."""

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def loss_scaler_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own master shard and fp16 inputs, spikes at drawn steps and ranks."""
    return draw(rng, case.world_size)


def loss_scaler_exercise(case: Case, LossScaler: Any, inputs: dict | None = None) -> list[dict]:
    r, dev = distlab.rank(), distlab.device()
    mine = inputs if inputs is not None else draw(torch.Generator().manual_seed(SEED), case.world_size)[r]
    scaler = LossScaler(**ARGS)
    master = torch.nn.Parameter(mine["w"].to(dev))            # this rank's fp32 master shard
    opt = ShardSGD([master], lr=LR)
    rows = []
    for t in range(STEPS):
        distlab.engine.runtime.progress(f"LossScaler, {case.world_size} ranks, step {t}")
        before = float(scaler.get_scale())
        w16 = master.detach().to(torch.float16).requires_grad_(True)   # the fp16 copy forward uses
        loss = (w16 * mine["x"][t].to(dev)).float().sum()            # fp16 forward, fp32 loss
        scaler.scale(loss).backward()                                # fp16 backward: may overflow
        master.grad = w16.grad.float()                               # fp16 gradient into the fp32 master
        scaler.step(opt)
        scaler.update()
        rows.append({"scale": before, "after": float(scaler.get_scale()),
                     "w": master.detach().cpu().clone()})
        opt.zero_grad(set_to_none=True)
    return rows


def loss_scaler_reference(case: Case, inputs: list | None = None) -> dict:
    """The inputs themselves: the judge replays each step from the ranks' own reports."""
    if inputs is None:
        inputs = draw(torch.Generator().manual_seed(SEED), case.world_size)
    return {"w": [i["w"] for i in inputs], "x": [i["x"] for i in inputs]}


def loss_scaler_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    skip_line, scale_line, agree_line = case.lines
    facts = _replay(outputs, reference)
    return [check_line(skip_line, lambda: _skip(outputs, facts)), check_line(scale_line, lambda: _scale(outputs, facts)),
            check_line(agree_line, lambda: _agree(outputs, facts))]


def _what(x: torch.Tensor) -> str:
    return "a nan" if bool(torch.isnan(x).any()) else "an inf"


def _replay(outputs: list, reference: dict) -> dict:
    """Per step: each rank's own gradient at the scale it reported, whether it overflowed, whether it moved,
    and the weights a correct step from its previous weights gives."""
    n = len(outputs)
    expect(all(len(rows) == STEPS for rows in outputs), f"expected {STEPS} steps from every rank")
    local, moved, want = [[None] * STEPS for _ in range(n)], [[None] * STEPS for _ in range(n)], \
        [[None] * STEPS for _ in range(n)]
    grads, prevs = [[None] * STEPS for _ in range(n)], [[None] * STEPS for _ in range(n)]
    for r, rows in enumerate(outputs):
        prev = reference["w"][r].float()
        for t, row in enumerate(rows):
            g = fp16_grad(float(row["scale"]), reference["x"][r][t])
            grads[r][t], prevs[r][t] = g, prev
            local[r][t] = not bool(torch.isfinite(g).all())
            moved[r][t] = not torch.equal(row["w"], prev)
            want[r][t] = prev.clone().add_(g / float(row["scale"]), alpha=-LR) if not local[r][t] else prev
            prev = row["w"].float()
    overflow = [any(local[r][t] for r in range(n)) for t in range(STEPS)]
    return {"local": local, "moved": moved, "want": want, "grads": grads, "prev": prevs, "overflow": overflow}


def _skip(outputs: list, f: dict) -> str:
    for t in range(STEPS):
        for r, rows in enumerate(outputs):
            row, got = rows[t], rows[t]["w"]
            at = f"step {t} (scale {row['scale']:g}), rank {r}"
            if f["local"][r][t]:
                expect(not f["moved"][r][t], f"{at}: the gradient held {_what(f['grads'][r][t])} but the weights "
                       "changed: skip optimizer.step() when any gradient is not finite (torch.isfinite catches "
                       "inf and nan)")
                continue
            if f["overflow"][t]:
                continue                       # another rank overflowed: the `ranks agree` line's business
            want = f["want"][r][t]
            if torch.allclose(got, want, atol=1e-6, rtol=1e-6):
                continue
            prev = f["prev"][r][t]
            expect(f["moved"][r][t], f"{at}: no rank overflowed but the weights did not move: call "
                   "optimizer.step() when every gradient is finite")
            ratio = (got - prev).abs().max().item() / max((want - prev).abs().max().item(), 1e-30)
            expect(abs(ratio - row["scale"]) > 0.01 * row["scale"], f"{at}: the weights moved {row['scale']:g}x "
                   "too far: divide the gradients by the scale (unscale) before optimizer.step()")
            raise CheckFailed(f"{at}: max |weights - (previous - lr x grad / scale)| = "
                              f"{(got - want).abs().max().item():.1e}: unscale every gradient (grad / scale, in "
                              "fp32), then optimizer.step()")
    return "weights unchanged where the gradient overflowed, moved by -lr x grad / scale elsewhere"


def _scale(outputs: list, f: dict) -> str:
    for r, rows in enumerate(outputs):
        expect(rows[0]["scale"] == INIT_SCALE, f"rank {r}: the first step used scale {rows[0]['scale']:g}, expected "
               f"init_scale = {INIT_SCALE:g}")
        good = 0
        for t, row in enumerate(rows):
            at = f"rank {r}, step {t}"
            expect(t == 0 or row["scale"] == rows[t - 1]["after"], f"{at}: get_scale() says {row['scale']:g} at the "
                   f"start of the step, {rows[t - 1]['after']:g} after the previous update(): only update() may "
                   "change the scale")
            # what this rank believed: its own overflow, or another rank's that made it skip
            seen = f["local"][r][t] or (f["overflow"][t] and not f["moved"][r][t])
            if seen:
                want, good = row["scale"] * BACKOFF, 0
                where = _what(f["grads"][r][t]) if f["local"][r][t] else "on another rank"
                expect(row["after"] == want, f"{at}: the step overflowed ({where}) and the scale went "
                       f"{row['scale']:g} -> {row['after']:g}; expected x backoff_factor = {want:g}")
                continue
            good += 1
            want = row["scale"] * GROWTH if good == INTERVAL else row["scale"]
            if good == INTERVAL:
                good = 0
            expect(row["after"] == want, f"{at}: the scale went {row['scale']:g} -> {row['after']:g} after "
                   f"{INTERVAL if want != row['scale'] else good} good step(s) in a row; expected {want:g} (grow x "
                   f"growth_factor after growth_interval = {INTERVAL} good steps in a row; the count restarts at "
                   "each overflow and each growth)")
    return "x backoff_factor on each overflow, x growth_factor after growth_interval good steps"


def _agree(outputs: list, f: dict) -> str:
    n = len(outputs)
    for t in range(STEPS):
        scales = [rows[t]["scale"] for rows in outputs]
        expect(len(set(scales)) == 1, f"step {t}: the ranks used scales {scales}: every rank must see the same "
               "overflows (all-reduce the found-inf flag), so that their scales never part")
        if not f["overflow"][t]:
            continue
        bad = [r for r in range(n) if r not in [q for q in range(n) if f["local"][q][t]]]
        for r in bad:
            q = next(q for q in range(n) if f["local"][q][t])
            expect(not f["moved"][r][t], f"step {t}: rank {q}'s gradient held {_what(f['grads'][q][t])} and rank "
                   f"{r} stepped anyway: all-reduce the found-inf flag (MAX, or SUM) across the ranks in step(), so "
                   "that every rank skips a step any rank overflowed in")
    return "every rank skips every step any rank overflowed in; one scale everywhere"
