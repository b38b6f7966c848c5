"""Lab 5's graded tasks: ZeRO-3 built in five steps, then in bf16.

1. `shard` — construction: rank r keeps slice r of rank 0's flattened,
   padded weights of every unit; the module keeps no parameter of its own.
2. `forward` — gather / free around each unit's forward: the same output as
   one process, one all-gather per unit, nothing gathered afterwards.
3. `backward` — gathered again for backward through saved-tensor hooks: every
   unit's gradient right, autograd keeps no gathered buffer alive between
   forward and backward, one more all-gather per unit.
4. `train` — async reduce-scatter into the shards: the same parameters as one
   process (per-block units, and the whole model as one unit), 3Ψ(N-1)/N
   algorithmic bytes, and between steps a rank holds only its shard.
5. `prefetch` — the next unit's all-gather starts before this unit computes,
   in forward and in backward; same result, same bytes.
6. `bf16` — no new code: bf16 on the wire, fp32 shards that still track an
   fp32 process.

References are computed here, from the same seeded model and batches, without
the learner's code. Under `distlab grade` the batches and every rank's different
starting weights are drawn from a secret seed instead (`inputs`), and each rank
receives only its own shard and weights (for `forward` and `backward` too: the
values judged are rank 0's model on each rank's rows). Every call whose values are judged is metered
and its traffic judged: each training step's, not only the first's.
"""
from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_weights, load_weights
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import compare, expect
from distlab.meters import held_bytes, track_comm
from distlab.course.models import build_model, lm_loss
from distlab.course.zero.units import qualified_names
from distlab.checks.ch05_common import (HANG, PRESET, _drawn_start, _model_names, _my_batch, _rank0_model,
                                        _rows, _start)
from distlab.checks.ch05_train import (bf16_exercise, bf16_inputs, bf16_judge, bf16_reference, prefetch_exercise,
                                       prefetch_inputs, prefetch_judge, prefetch_reference, train_exercise,
                                       train_inputs, train_judge, train_reference)


# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

import distlab
from distlab.engine.collectives import all_gather_tensor, reduce_scatter_tensor
from distlab.engine.precision import compute_dtype
from distlab.course.zero.units import GatherViews, Unit, block_units, direct_params, full_params, whole_model_unit"""

# ---- 1. construction ----------------------------------------------------------------------------


def shard_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own (different) starting weights."""
    return [drawn_weights(build_model(PRESET, seed=draw_seed(rng), device="cpu"), "")
            for _ in range(case.world_size)]


def shard_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
    distlab.engine.runtime.progress(f"ZeRO3(model) on {case.world_size} ranks, per-block units")
    model = (build_model(PRESET, seed=100 + distlab.rank()) if inputs is None    # every rank starts with
             else load_weights(build_model(PRESET), inputs, ""))                 # other weights
    with track_comm() as comm:
        zero = ZeRO3(model)
    return {"left": sum(p.numel() for p in model.parameters()), "comm": comm.stats(),
            "names": qualified_names(model, zero.units), "padded": [u.padded for u in zero.units],
            "shards": [u.shard.detach().clone() for u in zero.units],
            "leaf": [isinstance(u.shard, torch.nn.Parameter) and u.shard.requires_grad for u in zero.units],
            "held": held_bytes(vars(zero))}


def shard_reference(case: Case, inputs: list | None = None) -> dict:
    model = build_model(PRESET, seed=100, device="cpu")
    if inputs is not None:     # rank 0's drawn weights
        load_weights(model, inputs[0], "")
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "units": _model_names(model)}


def shard_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n = case.world_size
    values_line, only_line = case.lines
    params = reference["params"]

    def values() -> str:
        for r, out in enumerate(outputs):
            expect(len(out["names"]) == len(reference["units"]), f"rank {r}: {len(out['names'])} units, "
                   f"expected {len(reference['units'])} (block_units)")
            for i, (names, want_names) in enumerate(zip(out["names"], reference["units"])):
                expect(sorted(names) == sorted(want_names), f"rank {r}, unit {i}: parameters {names}, "
                       f"expected {want_names}")
                flat = torch.cat([params[k].reshape(-1) for k in names])
                padded = -(-flat.numel() // n) * n
                expect(out["padded"][i] == padded, f"rank {r}, unit {i}: padded to {out['padded'][i]}, "
                       f"expected {padded} (the next multiple of N)")
                flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
                per = padded // n
                compare(out["shards"][i], flat[r * per:(r + 1) * per], atol=0, rtol=0,
                        what=f"rank {r}'s shard of unit {i}")
                expect(out["leaf"][i], f"rank {r}, unit {i}: the shard must be an nn.Parameter (requires_grad)")
        return "fp32, flattened in unit order, padded to a multiple of N, from rank 0's weights"

    def only() -> str:
        for r, out in enumerate(outputs):
            expect(out["left"] == 0, f"rank {r}: the module still has {out['left']} parameter elements "
                   "of its own; set each slot to None")
            shards = 4 * sum(out["padded"]) // n
            expect(out["held"] == shards, f"rank {r}: ZeRO3 keeps {out['held']} B reachable; "
                   f"expected its fp32 shards only, {shards} B")
            calls = out["comm"].calls
            expect(set(calls) == {"broadcast"}, f"rank {r}: construction called {calls}; expected "
                   "one broadcast per unit")
        return "4 B per owned element, one broadcast per unit"

    return [check_line(values_line, values), check_line(only_line, only)]


# ---- 2. forward ---------------------------------------------------------------------------------


def forward_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return _drawn_start(case, rng)


def forward_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
    n, r = case.world_size, distlab.rank()
    distlab.engine.runtime.progress(f"a forward (no_grad) of ZeRO3, {n} ranks")
    zero = ZeRO3(_start(inputs))
    x, _ = _my_batch(0, n, r, inputs)
    with torch.no_grad(), track_comm() as comm:
        logits = zero(x)
    return {"logits": logits.float(), "comm": comm.stats(), "padded": [u.padded for u in zero.units],
            "full": sum(u.full is not None for u in zero.units),
            "pending": sum(u.pending is not None for u in zero.units),
            "gathered": len(zero._gathered), "held": held_bytes(vars(zero))}


def forward_reference(case: Case, inputs: list | None = None) -> list:
    model = _rank0_model(inputs)
    with torch.no_grad():
        return [model(_rows(inputs, case.world_size, r)[0]) for r in range(case.world_size)]


def forward_judge(case: Case, outputs: list, reference: list) -> list[Line]:
    n = case.world_size
    values_line, gather_line = case.lines

    def values() -> str:
        for r, out in enumerate(outputs):
            compare(out["logits"], reference[r], atol=1e-5, rtol=1e-4, what=f"rank {r}'s logits")
        return "every rank computes its rows with the whole model's weights"

    def gathers() -> str:
        for r, out in enumerate(outputs):
            units, padded = len(out["padded"]), sum(out["padded"])
            want = padded * 4 * (n - 1) // n
            expect(out["comm"].calls == {"all_gather": units}, f"rank {r}: forward called "
                   f"{out['comm'].calls}; expected one all-gather per unit ({units})")
            expect(out["comm"].total_bytes == want, f"rank {r}: forward sent {out['comm'].total_bytes} "
                   f"algorithmic bytes; expected Ψ x 4 x (N-1)/N = {want}")
            left = out["full"] + out["pending"] + out["gathered"]
            expect(left == 0, f"rank {r}: after forward {out['full']} unit(s) still gathered, "
                   f"{out['pending']} pending, {out['gathered']} in _gathered: free each unit after its forward")
            expect(out["held"] == 4 * padded // n, f"rank {r}: ZeRO3 keeps {out['held']} B reachable after "
                   f"forward; expected its shards only, {4 * padded // n} B")
        return "Ψ(N-1)/N in one all-gather per unit, only the shards left afterwards"

    return [check_line(values_line, values), check_line(gather_line, gathers)]


# ---- 3. backward: gathered again, not kept by autograd -----------------------------------------

def _settled(count: Any, within_s: float = 1.0) -> int:
    """`count()` of buffers still alive, once nothing but the program holds them (0 as soon as it is 0).

    Two things hold a freed buffer a moment longer without the program keeping it: a reference cycle
    (freed at the next collection, whenever that runs: collected here), and the backend. gloo's worker
    thread marks an op done (so `wait()` returns) and only then drops its own reference to the op, which
    holds the op's output: for a moment after `wait()`, the last gathered buffer is still alive. Counted
    at once, that failed a correct answer about one launch in 40. A buffer autograd really keeps stays
    alive however long this waits."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        n = count()
        if n == 0 or time.monotonic() >= deadline:
            return n
        time.sleep(0.01)


def backward_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return _drawn_start(case, rng)


def backward_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
    n, r = case.world_size, distlab.rank()

    class Probe(ZeRO3):
        """Records each unit's gradients instead of reduce-scattering them (step 4 is not written
        yet), and a weak reference to every gathered buffer."""

        def _reduce_scatter(self, unit, grads):
            self.seen[unit.index] = [None if g is None else g.detach().float().clone() for g in grads]
            self._free(unit)

        def _wait_gather(self, unit):
            full = super()._wait_gather(unit)
            self.born.append(weakref.ref(full.untyped_storage()))
            return full

    distlab.engine.runtime.progress(f"forward and backward of ZeRO3 (gradients recorded), {n} ranks")
    model = _start(inputs)
    zero = Probe(model)
    zero.seen, zero.born = {}, []
    x, y = _my_batch(0, n, r, inputs)
    with track_comm() as forward:
        loss = lm_loss(zero, x, y)
    # while autograd holds the graph; only what is reachable counts (see `_settled`)
    alive = _settled(lambda: sum(w() is not None for w in zero.born))
    with track_comm() as backward:
        loss.backward()
    names = qualified_names(model, zero.units)
    grads = {k: g for i, unit_names in enumerate(names) for k, g in zip(unit_names, zero.seen.get(i, []))}
    return {"grads": grads, "alive": alive, "forward": forward.stats(), "backward": backward.stats(),
            "units": len(zero.units)}


def backward_reference(case: Case, inputs: list | None = None) -> list:
    out = []
    for r in range(case.world_size):
        model = _rank0_model(inputs)
        x, y = _rows(inputs, case.world_size, r)
        lm_loss(model, x, y).backward()
        out.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    return out


def backward_judge(case: Case, outputs: list, reference: list) -> list[Line]:
    values_line, regather_line = case.lines

    def values() -> str:
        for r, out in enumerate(outputs):
            expect(set(out["grads"]) == set(reference[r]), f"rank {r}: gradients reached "
                   f"{len(out['grads'])} parameters; expected all {len(reference[r])} (GatherViews.backward "
                   "calls _reduce_scatter once per unit)")
            for k, want in reference[r].items():
                got = out["grads"][k]
                expect(got is not None, f"rank {r}: no gradient for {k}")
                compare(got.reshape(want.shape), want, atol=1e-5, rtol=1e-4, what=f"rank {r}'s gradient of {k}")
        return "each rank's gradient of its own rows, for every parameter"

    def regather() -> str:
        for r, out in enumerate(outputs):
            units = out["units"]
            expect(out["alive"] == 0, f"rank {r}: between forward and backward autograd kept "
                   f"{out['alive']} gathered buffer(s) alive: _pack must store a marker, not the tensor")
            for phase in ("forward", "backward"):
                calls = out[phase].calls
                expect(calls == {"all_gather": units}, f"rank {r}: {phase} called {calls}; expected one "
                       f"all-gather per unit ({units})")
        return "one all-gather per unit in forward and again in backward; saved weights stored as markers"

    return [check_line(values_line, values), check_line(regather_line, regather)]


TASKS = table(
    task("shard", "ZeRO3",
         per_ranks((2, 4), "shard, {n} ranks: rank r keeps slice r of rank 0's weights, unit by unit",
                   "shard, {n} ranks: nothing else (the module's parameters freed)"),
         inputs=shard_inputs, exercise=shard_exercise, reference=shard_reference, judge=shard_judge, hang_hint=HANG),
    task("forward", "ZeRO3",
         per_ranks((2, 4), "forward, {n} ranks: the same logits as one process",
                   "forward, {n} ranks: one all-gather per unit, freed after use"),
         inputs=forward_inputs, exercise=forward_exercise, reference=forward_reference, judge=forward_judge,
         hang_hint=HANG),
    task("backward", "ZeRO3",
         per_ranks((2, 4), "backward, {n} ranks: every unit's gradient",
                   "backward, {n} ranks: gathered again for backward, not kept by autograd"),
         inputs=backward_inputs, exercise=backward_exercise, reference=backward_reference, judge=backward_judge,
         hang_hint=HANG),
    task("train", "ZeRO3",
         per_ranks((2, 4), "train, {n} ranks: per-block units match one process",
                   "train, {n} ranks: the whole model as one unit matches one process",
                   "train, {n} ranks: traffic 3Ψ(N-1)/N",
                   "train, {n} ranks: between steps a rank holds only its shard"),
         inputs=train_inputs, exercise=train_exercise, reference=train_reference, judge=train_judge, hang_hint=HANG),
    task("prefetch", "ZeRO3",
         per_ranks((2,), "prefetch, {n} ranks: matches one process, same traffic",
                   "prefetch, {n} ranks: the next unit's all-gather starts before this unit computes"),
         inputs=prefetch_inputs, exercise=prefetch_exercise, reference=prefetch_reference, judge=prefetch_judge,
         hang_hint=HANG),
    task("bf16", "ZeRO3",
         per_ranks((2,), "bf16, {n} ranks: bf16 on the wire, 3Ψ·2·(N-1)/N",
                   "bf16, {n} ranks: fp32 shards close to one fp32 process"),
         inputs=bf16_inputs, exercise=bf16_exercise, reference=bf16_reference, judge=bf16_judge, hang_hint=HANG),
)

grade = grader(TASKS)
