"""Lab 3's graded tasks: a ZeRO-1 sharded optimizer, built in four steps.

The lab's `ShardedOptimizer` keeps the trainable parameters in one flat
buffer padded to a multiple of N (`flat_param`, with `flat_grad` beside it),
and rank r owns the slice `shard` = elements [r·k, (r+1)·k), k = ceil(Ψ/N).
The tasks follow the lab's steps:

- `init`: the constructor. Every `p.data` / `p.grad` is a view into the flat
  buffers (on the parameters' device, in their dtype), every rank starts from
  rank 0's weights (broadcast by the metered constructor, nothing else), and the
  inner optimizer holds exactly this rank's shard;
- `reduce_scatter_grad`: this rank's slice of the mean gradient, compared with
  one process's full-batch gradient; one reduce-scatter, (N-1)/N·S bytes;
- `all_gather_params`: every rank's shard lands in every rank's parameters;
  one all-gather, (N-1)/N·S bytes;
- `step`: the whole optimizer. Four steps with SGD, AdamW (fp32) and the bf16
  recipe (`MixedPrecisionAdam`) on the frozen and the tied model match one
  process on the whole batch (bf16: within two rounding steps, and at most 2%
  of the weights more than one step away); each rank keeps the optimizer states of its own
  shard only; every step (each metered: the parameters after all of them are
  judged) sends 2Ψ·b·(N-1)/N algorithmic bytes in reduce-scatters and
  all-gathers, nothing else;
- `loss_scaler`: fp16 dynamic loss scaling on 2 ranks, each with its own shard
  (`ch03_scaler`): overflowing steps skipped, the others unscaled, the scale
  backed off and grown, and every rank skipping the same steps.

Every reference is computed here, on the CPU, without learner code. In the
notebook the batches, every rank's different starting weights and what each rank
writes into its shard before the all-gather are seeded by the package; under
`distlab grade` they are drawn from a secret seed (each task's `inputs`) and each
rank receives only its own.
"""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_batch_shards, drawn_weights, full_batches, load_weights
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import compare, expect
from distlab.course.data_parallel.reference import full_batch_gradient, make_model, trainable
from distlab.meters import track_comm
from distlab.course.models import lm_loss
from distlab.theory import collective_bytes_sent
from distlab.checks.ch03_common import (BATCH, HANG_HINT, INNER_SGD, LAYOUT_DTYPES, SEED_OFFSET, _batch,
                                        _full_gradient, _k, _named, _pattern, _psi, _traffic, _where)
from distlab.checks.ch03_step import STEP_LINES, step_exercise, step_inputs, step_judge, step_reference
from distlab.checks.ch03_scaler import HANG_HINT as SCALER_HANG_HINT
from distlab.checks.ch03_scaler import (loss_scaler_exercise, loss_scaler_inputs, loss_scaler_judge,
                                        loss_scaler_reference)


# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist

import distlab
from distlab import add_to_class
from distlab.engine.collectives import all_gather_tensor, reduce_scatter_tensor"""


def init_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own starting weights of both models."""
    return [{k: v for variant, dtype in LAYOUT_DTYPES.items()
             for k, v in drawn_weights(make_model(variant, dtype=dtype, seed=draw_seed(rng), device="cpu"),
                                       f"{variant}.").items()} for _ in range(case.world_size)]


def init_exercise(case: Case, Opt: Any, inputs: dict | None = None) -> dict:
    out: dict = {}
    for variant, dtype in LAYOUT_DTYPES.items():
        distlab.engine.runtime.progress(f"ShardedOptimizer.__init__, {distlab.world_size()} ranks, {variant} weights, "
                                 f"{str(dtype).replace('torch.', '')}")
        model = (make_model(variant, dtype=dtype, seed=SEED_OFFSET + distlab.rank()) if inputs is None
                 else load_weights(make_model(variant, dtype=dtype), inputs, f"{variant}."))
        with track_comm() as comm:       # the weights judged come from the calls it counts
            opt = Opt(model.parameters(), torch.optim.SGD, **INNER_SGD)
        fp, fg = opt.flat_param, opt.flat_grad
        out[variant] = {
            "params": _named(model), "comm": comm.stats(),
            "flat": [(t.numel(), t.dtype, str(t.device)) + _where(t) for t in (fp, fg)],
            "views": {k: (_where(p), None if p.grad is None else _where(p.grad))
                      for k, p in model.named_parameters()},
            "shard": (opt.shard.numel(),) + _where(opt.shard),
            "inner": sorted((q.data_ptr(), q.numel(), q.untyped_storage().data_ptr())
                            for g in opt.optim.param_groups for q in g["params"]),
            "device": str(next(model.parameters()).device),
        }
    return out


def init_reference(case: Case, inputs: list | None = None) -> dict:
    ref = {}
    for v, d in LAYOUT_DTYPES.items():   # frozen parameters are not the optimizer's: only trainable ones
        model = make_model(v, dtype=d, seed=SEED_OFFSET, device="cpu")
        if inputs is not None:           # rank 0's drawn weights
            load_weights(model, inputs[0], f"{v}.")
        ref[v] = (_psi(v), {k: p.detach().clone() for k, p in trainable(model)})
    return ref


def init_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n = case.world_size
    flat_line, start_line, shard_line = case.lines

    def flat() -> str:
        for variant, dtype in LAYOUT_DTYPES.items():
            (psi, params), _ = reference[variant]
            size = dtype.itemsize
            for r, out in enumerate(outputs):
                o = out[variant]
                for what, (numel, got_dtype, device, ptr, storage) in zip(("flat_param", "flat_grad"), o["flat"]):
                    expect(numel == _k(psi, n) * n, f"{variant} weights, rank {r}: {what} has {numel} elements, "
                                                    f"expected ceil(Psi/N) x N = {_k(psi, n) * n} (Psi = {psi})")
                    expect(got_dtype == dtype, f"{variant} weights: {what} is {got_dtype}, the parameters {dtype}")
                    expect(device == o["device"], f"{what} is on {device}, the parameters on {o['device']}")
                (_, _, _, p_ptr, p_storage), (_, _, _, g_ptr, g_storage) = o["flat"]
                offset = 0
                for k, m in params:
                    (data, data_storage), grad = o["views"][k]
                    expect(data_storage == p_storage and data == p_ptr + offset * size,
                           f"{variant} weights, rank {r}: {k} is not a view of flat_param at element {offset}")
                    expect(grad is not None and grad == (g_ptr + offset * size, g_storage),
                           f"{variant} weights, rank {r}: {k}.grad is not a view of flat_grad at element {offset}")
                    offset += m
                frozen = [k for k in o["views"] if k not in dict(params)]
                for k in frozen:
                    expect(o["views"][k][0][1] != p_storage, f"rank {r}: the frozen {k} is in flat_param")
        return "every trainable p.data and p.grad is a view into padded flat buffers"

    def start() -> str:
        for variant in LAYOUT_DTYPES:
            _, want = reference[variant]
            for r, out in enumerate(outputs):
                for k, v in want.items():
                    compare(out[variant]["params"][k], v, atol=0, rtol=0, what=f"rank {r}'s {k}")
            for r, out in enumerate(outputs):   # ... made by the broadcasts its construction's meter counted
                calls = out[variant]["comm"].calls
                expect(set(calls) <= {"broadcast"} and calls.get("broadcast", 0) >= 1,
                       f"{variant} weights, rank {r}: construction called {calls or 'nothing'}; expected "
                       "broadcast only (rank 0's weights to every rank)")
        return "every rank holds rank 0's weights"

    def shard() -> str:
        for variant, dtype in LAYOUT_DTYPES.items():
            (psi, _), _ = reference[variant]
            k, size = _k(psi, n), dtype.itemsize
            for r, out in enumerate(outputs):
                o = out[variant]
                _, _, _, p_ptr, p_storage = o["flat"][0]
                numel, ptr, storage = o["shard"]
                expect(numel == k and storage == p_storage and ptr == p_ptr + r * k * size,
                       f"{variant} weights, rank {r}: shard is not elements [{r * k}, {(r + 1) * k}) of flat_param")
                at = p_ptr + r * k * size
                for q_ptr, q_numel, q_storage in o["inner"]:
                    expect(q_storage == p_storage and q_ptr == at,
                           f"{variant} weights, rank {r}: the inner optimizer's tensors are not consecutive "
                           "pieces of this rank's shard of flat_param")
                    at += q_numel * size
                expect(at == p_ptr + (r + 1) * k * size, f"{variant} weights, rank {r}: the inner optimizer "
                                                         f"holds {(at - p_ptr) // size - r * k} elements, expected {k}")
        return f"rank r updates elements [r*k, (r+1)*k) of flat_param, k = ceil(Psi/N)"

    return [check_line(flat_line, flat), check_line(start_line, start), check_line(shard_line, shard)]


def reduce_scatter_grad_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of the batch."""
    return drawn_batch_shards(rng, case.world_size, 1, BATCH)


def reduce_scatter_grad_exercise(case: Case, Opt: Any, inputs: dict | None = None) -> dict:
    r, n = distlab.rank(), distlab.world_size()
    out: dict = {}
    for variant in ("frozen", "tied"):
        distlab.engine.runtime.progress(f"_reduce_scatter_grad, {n} ranks, {variant} weights")
        model = make_model(variant)
        opt = Opt(model.parameters(), torch.optim.SGD, **INNER_SGD)
        x, y = _batch(0, r, n, inputs)
        lm_loss(model, x, y).backward()
        with track_comm() as comm:
            g = opt._reduce_scatter_grad()
        out[variant] = g.detach().clone()
        out[variant, "comm"] = comm.stats()
    return out


def reduce_scatter_grad_reference(case: Case, inputs: list | None = None) -> dict:
    n, ref = case.world_size, {}
    for variant in ("frozen", "tied"):
        flat = (full_batch_gradient(variant, batch_size=BATCH) if inputs is None
                else _full_gradient(variant, *full_batches(inputs, 1)[0]))
        k = _k(flat.numel(), n)
        ref[variant] = list(torch.nn.functional.pad(flat, (0, k * n - flat.numel())).split(k))
        ref[variant, "bytes"] = collective_bytes_sent("reduce_scatter", 4 * k * n, n)
    return ref


def reduce_scatter_grad_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    values_line, traffic_line = case.lines

    def values() -> str:
        for variant in ("frozen", "tied"):
            for r, out in enumerate(outputs):
                compare(out[variant], reference[variant][r], atol=1e-6, rtol=1e-4,
                        what=f"{variant} weights, rank {r}'s gradient shard")
        return "each rank holds its slice of the full-batch mean gradient"

    return [check_line(values_line, values),
            check_line(traffic_line, lambda: _traffic(outputs, {"reduce_scatter": reference["frozen", "bytes"]},
                                                  ("frozen", "comm")))]


def all_gather_params_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: what each rank writes into its shard, drawn (integers < 256: exact in bf16)."""
    n = case.world_size
    return [{variant: torch.randint(0, 256, (_k(_psi(variant)[0], n),), generator=rng).to(dtype)
             for variant, dtype in LAYOUT_DTYPES.items()} for _ in range(n)]


def all_gather_params_exercise(case: Case, Opt: Any, inputs: dict | None = None) -> dict:
    r = distlab.rank()
    out: dict = {}
    for variant, dtype in LAYOUT_DTYPES.items():
        distlab.engine.runtime.progress(f"_all_gather_params, {distlab.world_size()} ranks, {variant} weights, "
                                 f"{str(dtype).replace('torch.', '')}")
        model = make_model(variant, dtype=dtype)
        opt = Opt(model.parameters(), torch.optim.SGD, **INNER_SGD)
        mine = _pattern(r, opt.shard.numel(), dtype) if inputs is None else inputs[variant]
        with torch.no_grad():
            opt.shard.copy_(mine)                                                   # "my updated shard"
        with track_comm() as comm:
            opt._all_gather_params()
        out[variant] = _named(model)
        out[variant, "comm"] = comm.stats()
    return out


def all_gather_params_reference(case: Case, inputs: list | None = None) -> dict:
    n, ref = case.world_size, {}
    for variant, dtype in LAYOUT_DTYPES.items():
        psi, params = _psi(variant)
        k = _k(psi, n)
        full = torch.cat([_pattern(r, k, dtype) if inputs is None else inputs[r][variant] for r in range(n)])
        want = _named(make_model(variant, dtype=dtype, device="cpu"))   # frozen ones stay as they were
        offset = 0
        for name, m in params:
            want[name] = full[offset:offset + m].view_as(want[name])
            offset += m
        ref[variant] = want
        ref[variant, "bytes"] = collective_bytes_sent("all_gather", dtype.itemsize * k * n, n)
    return ref


def all_gather_params_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    values_line, traffic_line = case.lines

    def values() -> str:
        for variant in LAYOUT_DTYPES:
            for r, out in enumerate(outputs):
                for k, want in reference[variant].items():
                    compare(out[variant][k], want, atol=0, rtol=0, what=f"{variant} weights, rank {r}'s {k}")
        return "every rank's parameters hold every rank's shard"

    def traffic() -> str:
        for variant in LAYOUT_DTYPES:
            _traffic(outputs, {"all_gather": reference[variant, "bytes"]}, (variant, "comm"))
        return "all-gather only, (N-1)/N x S bytes"

    return [check_line(values_line, values), check_line(traffic_line, traffic)]


# The constructor's only collective is the broadcast of rank 0's weights.
INIT_HANG_HINT = ("The constructor hangs when the ranks do not broadcast the same tensors in the same order: "
                  "every rank must broadcast every parameter from rank 0 (src=0), the same ones, in the same order.")

TASKS = table(
    task("init", "ShardedOptimizer",
         per_ranks((2, 3), "ShardedOptimizer.__init__, {n} ranks: flat buffers and views",
                   "ShardedOptimizer.__init__, {n} ranks: starts from rank 0's weights",
                   "ShardedOptimizer.__init__, {n} ranks: the inner optimizer holds this rank's shard only"),
         inputs=init_inputs, exercise=init_exercise, reference=init_reference, judge=init_judge,
         hang_hint=INIT_HANG_HINT),
    task("reduce_scatter_grad", "ShardedOptimizer",
         per_ranks((2, 3), "_reduce_scatter_grad, {n} ranks, values", "_reduce_scatter_grad, {n} ranks, traffic"),
         inputs=reduce_scatter_grad_inputs, exercise=reduce_scatter_grad_exercise,
         reference=reduce_scatter_grad_reference, judge=reduce_scatter_grad_judge, hang_hint=HANG_HINT),
    task("all_gather_params", "ShardedOptimizer",
         per_ranks((2, 3), "_all_gather_params, {n} ranks, values", "_all_gather_params, {n} ranks, traffic"),
         inputs=all_gather_params_inputs, exercise=all_gather_params_exercise, reference=all_gather_params_reference,
         judge=all_gather_params_judge, hang_hint=HANG_HINT),
    task("step", "ShardedOptimizer",
         per_ranks((2, 4), *STEP_LINES),    # every recipe on frozen and tied weights, sharding, traffic
         inputs=step_inputs, exercise=step_exercise, reference=step_reference, judge=step_judge, hang_hint=HANG_HINT),
    task("loss_scaler", "LossScaler",
         per_ranks((2,), "LossScaler, {n} ranks: overflowing steps skipped, the others unscaled and taken",
                   "LossScaler, {n} ranks: the scale backs off on overflow and grows after good steps",
                   "LossScaler, {n} ranks: every rank skips the same steps, with the same scale"),
         inputs=loss_scaler_inputs, exercise=loss_scaler_exercise, reference=loss_scaler_reference,
         judge=loss_scaler_judge, hang_hint=SCALER_HANG_HINT),
)

grade = grader(TASKS)
