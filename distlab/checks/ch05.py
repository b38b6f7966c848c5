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

import functools
import gc
import time
import weakref
from typing import Any

import torch

import distlab
from distlab.checks.task import (Case, Line, Task, draw_seed, drawn_batch_shards, drawn_weights, full_batches,
                                 grader, judged, load_weights)
from distlab.checks.verdict import CheckFailed, compare, expect
from distlab.meters import held_bytes, track_comm, track_memory
from distlab.course.models import build_model, lm_loss, split_batch, synthetic_batch
from distlab.course.zero.units import block_units, full_params, qualified_names, whole_model_unit

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

import distlab
from distlab.engine.collectives import all_gather_tensor, reduce_scatter_tensor
from distlab.engine.precision import compute_dtype
from distlab.course.zero.units import GatherViews, Unit, block_units, direct_params, full_params, whole_model_unit"""

PRESET, STEPS, BATCH = "tiny", 3, 8
HANG = ("ZeRO-3 hangs when ranks disagree on the collectives: every rank must gather and reduce-scatter "
        "the same units in the same order (a unit gathered twice on one rank and once on another waits "
        "forever), and every async work must be waited for.")


def make_opt(shards: list) -> torch.optim.Optimizer:
    """The checks' optimizer: SGD with momentum (a missing or doubled 1/N changes the result)."""
    return torch.optim.SGD(shards, lr=0.5, momentum=0.9)


def _batch(step: int, n: int, r: int, device: Any = None):
    cfg = build_model(PRESET, device="cpu").config
    return split_batch(synthetic_batch(step, BATCH, cfg, device=device), r, n)


def _model_names(model: torch.nn.Module) -> list[list[str]]:
    """The qualified parameter names of each of `block_units(model)`, in module order."""
    qual = {id(m): name for name, m in model.named_modules()}
    out = []
    for modules in block_units(model):
        names = []
        for mod in modules:
            for sub in mod.modules():
                for attr, p in sub._parameters.items():
                    if p is not None:
                        names.append(f"{qual[id(sub)]}.{attr}")
        out.append(names)
    return out


def _my_batch(step: int, n: int, r: int, inputs: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's shard of step `step`'s batch: the package's in the notebook, drawn under grading (`inputs`)."""
    if inputs is None:
        return _batch(step, n, r)
    dev = distlab.device()
    return inputs[f"x{step}"].to(dev), inputs[f"y{step}"].to(dev)


def _drawn_start(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own (different) starting weights under "w." and its shard of one batch: the
    values judged are rank 0's model on each rank's rows, which no rank can rebuild without the broadcast and
    the gathers."""
    return [{**drawn_weights(build_model(PRESET, seed=draw_seed(rng), device="cpu"), "w."), **shard}
            for shard in drawn_batch_shards(rng, case.world_size, 1, BATCH, PRESET)]


def _start(inputs: dict | None) -> torch.nn.Module:
    """On the rank: the model, the package's or with this rank's drawn weights (its rows: `_my_batch(0, ...)`)."""
    return build_model(PRESET) if inputs is None else load_weights(build_model(PRESET), inputs, "w.")


def _rank0_model(inputs: list | None) -> torch.nn.Module:
    """Here: the model every rank computes with after the broadcast (rank 0's drawn weights under grading)."""
    model = build_model(PRESET, device="cpu")
    return model if inputs is None else load_weights(model, inputs[0], "w.")


def _rows(inputs: list | None, n: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _batch(0, n, r, device="cpu") if inputs is None else (inputs[r]["x0"], inputs[r]["y0"])


def _drawn_batches(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of each step's batch."""
    return drawn_batch_shards(rng, case.world_size, STEPS, BATCH, PRESET)


def _train_on(batches: list) -> dict[str, torch.Tensor]:
    """`_train_single` on given (drawn) whole batches."""
    model = build_model(PRESET, device="cpu")
    opt = make_opt(model.parameters())
    for x, y in batches:
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _trained(inputs: list | None) -> dict[str, torch.Tensor]:
    return _train_single() if inputs is None else _train_on(full_batches(inputs, STEPS))


@functools.lru_cache(maxsize=None)
def _train_single(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The ground truth: one process (CPU), the whole batch."""
    model = build_model(PRESET, device="cpu")
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = synthetic_batch(step, BATCH, model.config, device="cpu")
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _compare_params(outputs: list, key: Any, ref: dict, atol: float, rtol: float, label: str) -> None:
    for r, out in enumerate(outputs):
        mine = out[key]
        expect(set(mine) == set(ref), f"rank {r}, {label}: parameters {sorted(mine)[:3]}...; "
               f"expected {sorted(ref)[:3]}...")
        for k, v in ref.items():
            try:
                compare(mine[k], v, atol=atol, rtol=rtol, what=f"rank {r}'s {k}")
            except CheckFailed as exc:
                raise CheckFailed(f"{label}: {exc}")


def _traffic(stats: Any, units: int, padded: int, n: int, b: int, at: str, when: str = "in one step") -> None:
    calls = {"all_gather": 2 * units, "reduce_scatter": units}
    expect(stats.calls == calls, f"{at}: collectives {stats.calls} {when}; expected {calls} "
           "(two all-gathers and one reduce-scatter per unit)")
    want = 3 * padded * b * (n - 1) // n
    expect(stats.total_bytes == want, f"{at}: {stats.total_bytes} algorithmic bytes {when}; expected "
           f"3 x {padded} x {b} x (N-1)/N = {want}")


def _traffic_per_step(steps: list, units: int, padded: int, n: int, b: int, at: str) -> None:
    """`_traffic` of every step: each step whose parameters the values line judges is metered and judged."""
    expect(len(steps) == STEPS, f"{at}: {len(steps)} metered steps, expected {STEPS}")
    for k, stats in enumerate(steps):
        _traffic(stats, units, padded, n, b, at, f"in step {k}")


# ---- 1. construction ----------------------------------------------------------------------------

class ShardTask(Task):
    name, answers, hang_hint = "shard", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(n, (f"shard, {n} ranks: rank r keeps slice r of rank 0's weights, unit by unit",
                         f"shard, {n} ranks: nothing else (the module's parameters freed)"))
                for n in (2, 4)]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Under grading: every rank's own (different) starting weights."""
        return [drawn_weights(build_model(PRESET, seed=draw_seed(rng), device="cpu"), "")
                for _ in range(case.world_size)]

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
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

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        model = build_model(PRESET, seed=100, device="cpu")
        if inputs is not None:     # rank 0's drawn weights
            load_weights(model, inputs[0], "")
        return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
                "units": _model_names(model)}

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
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

        return [judged(values_line, values), judged(only_line, only)]


# ---- 2. forward ---------------------------------------------------------------------------------

class ForwardTask(Task):
    name, answers, hang_hint = "forward", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(n, (f"forward, {n} ranks: the same logits as one process",
                         f"forward, {n} ranks: one all-gather per unit, freed after use"))
                for n in (2, 4)]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return _drawn_start(case, rng)

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
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

    def reference(self, case: Case, inputs: list | None = None) -> list:
        model = _rank0_model(inputs)
        with torch.no_grad():
            return [model(_rows(inputs, case.world_size, r)[0]) for r in range(case.world_size)]

    def judge(self, case: Case, outputs: list, reference: list) -> list[Line]:
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

        return [judged(values_line, values), judged(gather_line, gathers)]


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


class BackwardTask(Task):
    name, answers, hang_hint = "backward", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(n, (f"backward, {n} ranks: every unit's gradient",
                         f"backward, {n} ranks: gathered again for backward, not kept by autograd"))
                for n in (2, 4)]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return _drawn_start(case, rng)

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
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

    def reference(self, case: Case, inputs: list | None = None) -> list:
        out = []
        for r in range(case.world_size):
            model = _rank0_model(inputs)
            x, y = _rows(inputs, case.world_size, r)
            lm_loss(model, x, y).backward()
            out.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        return out

    def judge(self, case: Case, outputs: list, reference: list) -> list[Line]:
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

        return [judged(values_line, values), judged(regather_line, regather)]


# ---- 4. train: async reduce-scatter into the shards --------------------------------------------

VARIANTS = {"per-block units": dict(units=block_units), "whole model as one unit": dict(units=whole_model_unit)}


def _warm_up() -> None:
    """One forward and backward of a plain model on this rank's device, before memory is tracked: on
    a GPU the allocator and cuBLAS's workspace exist from then on."""
    model = build_model(PRESET)
    x, y = _batch(0, 1, 0)
    lm_loss(model, x, y).backward()


class TrainTask(Task):
    name, answers, hang_hint = "train", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(n, (f"train, {n} ranks: per-block units match one process",
                         f"train, {n} ranks: the whole model as one unit matches one process",
                         f"train, {n} ranks: traffic 3Ψ(N-1)/N",
                         f"train, {n} ranks: between steps a rank holds only its shard"))
                for n in (2, 4)]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return _drawn_batches(case, rng)

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
        n, r, out = case.world_size, distlab.rank(), {}
        _warm_up()
        batches = [_my_batch(step, n, r, inputs) for step in range(STEPS)]   # made before the meter runs
        for variant, kw in VARIANTS.items():
            # The model is built inside the meter, so its full parameters are booked as born and as freed
            # when ZeRO3 shards them: CUDA's allocator counters see both (a model built before the meter
            # would show there as 4 bytes per element freed, which the CPU meter never booked).
            with track_memory() as mem:
                model = build_model(PRESET)
                zero = ZeRO3(model, optimizer=make_opt, **kw)
                for step, (x, y) in enumerate(batches):
                    distlab.engine.runtime.progress(f"{variant}, {n} ranks, step {step}")
                    with track_comm() as comm:
                        lm_loss(zero, x, y).backward()
                    zero.optimizer.step()
                    zero.optimizer.zero_grad(set_to_none=False)   # keep the gradient shards: 12 B/element
                    out.setdefault((variant, "comm"), []).append(comm.stats())   # every step whose values count
                out[variant, "alive"] = mem.current_bytes
            out[variant, "held"] = held_bytes(vars(zero))
            out[variant, "padded"] = [u.padded for u in zero.units]
            out[variant, "left"] = sum(p.numel() for p in model.parameters())
            out[variant] = full_params(model, zero.units)
        out["device"] = distlab.device().type
        return out

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        return _trained(inputs)

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        n = case.world_size
        block_line, whole_line, traffic_line, only_line = case.lines

        def matches(variant: str) -> Any:
            def fn() -> str:
                # atol 1e-5: the sum over ranks of per-rank means is not bit-identical to one mean.
                _compare_params(outputs, variant, reference, 1e-5, 1e-4, variant)
                return f"the same parameters as one process on the whole batch after {STEPS} SGD steps"
            return fn

        def traffic() -> str:
            for r, out in enumerate(outputs):
                for variant in VARIANTS:
                    padded = out[variant, "padded"]
                    _traffic_per_step(out[variant, "comm"], len(padded), sum(padded), n, 4, f"rank {r}, {variant}")
            return "two all-gathers and one reduce-scatter per unit, 3Ψ·4·(N-1)/N algorithmic bytes"

        def only() -> str:
            for r, out in enumerate(outputs):
                for variant in VARIANTS:
                    per = sum(out[variant, "padded"]) // n
                    at = f"rank {r}, {variant}"
                    expect(out[variant, "left"] == 0, f"{at}: the model has {out[variant, 'left']} parameter "
                           "elements of its own between steps")
                    expect(out[variant, "held"] == 12 * per, f"{at}: ZeRO3 keeps {out[variant, 'held']} B "
                           f"reachable between steps; expected shards, their gradients and momentum: 12 x {per} B")
                    # The CUDA allocator rounds each block up to 512 B: 3 tensors (shard, grad, momentum) per unit.
                    tol = 0 if out["device"] == "cpu" else 512 * 3 * len(out[variant, "padded"])
                    expect(abs(out[variant, "alive"] - 12 * per) <= tol, f"{at}: the memory meter counts "
                           f"{out[variant, 'alive']} B alive between steps, expected 12 x {per} = {12 * per} B "
                           "(a gathered buffer or a gradient kept somewhere?)")
            return "12 bytes per owned element (parameter, gradient, momentum), nothing else alive"

        return [judged(block_line, matches("per-block units")), judged(whole_line, matches("whole model as one unit")),
                judged(traffic_line, traffic), judged(only_line, only)]


# ---- 5. prefetch ---------------------------------------------------------------------------------

class PrefetchTask(Task):
    name, answers, hang_hint = "prefetch", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(2, ("prefetch, 2 ranks: matches one process, same traffic",
                         "prefetch, 2 ranks: the next unit's all-gather starts before this unit computes"))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return _drawn_batches(case, rng)

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
        n, r = case.world_size, distlab.rank()

        class Probe(ZeRO3):
            """Logs when each unit's gather begins and when its gradients are handed over."""

            def _start_gather(self, unit):
                if unit.full is None and unit.pending is None:
                    self.events.append(("gather", unit.index))
                return super()._start_gather(unit)

            def _reduce_scatter(self, unit, grads):
                self.events.append(("reduce-scatter", unit.index))
                return super()._reduce_scatter(unit, grads)

        model = build_model(PRESET)
        zero = Probe(model, optimizer=make_opt, prefetch=True)
        zero.events = []
        for unit in zero.units:   # registered after ZeRO3's own pre-hook: runs once the unit is gathered
            unit.modules[0].register_forward_pre_hook(lambda m, a, i=unit.index: zero.events.append(("forward", i)))
        log, stats = None, []
        for step in range(STEPS):
            distlab.engine.runtime.progress(f"prefetch=True, {n} ranks, step {step}")
            x, y = _my_batch(step, n, r, inputs)
            with track_comm() as comm:
                lm_loss(zero, x, y).backward()
            zero.optimizer.step()
            zero.optimizer.zero_grad(set_to_none=True)
            stats.append(comm.stats())          # every step whose values count
            if step == 0:
                log = list(zero.events)
        return {"params": full_params(model, zero.units), "events": log, "comm": stats,
                "padded": [u.padded for u in zero.units]}

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        return _trained(inputs)

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        n = case.world_size
        match_line, order_line = case.lines

        def matches() -> str:
            _compare_params(outputs, "params", reference, 1e-5, 1e-4, "prefetch=True")
            for r, out in enumerate(outputs):
                _traffic_per_step(out["comm"], len(out["padded"]), sum(out["padded"]), n, 4, f"rank {r}")
            return "prefetch changes when bytes move, not what is computed or how many bytes"

        def order() -> str:
            for r, out in enumerate(outputs):
                ev, units = out["events"], len(out["padded"])
                last_forward = ev.index(("forward", units - 1))
                for i in range(units - 1):
                    expect(ev.index(("gather", i + 1)) < ev.index(("forward", i)),
                           f"rank {r}: in forward, unit {i + 1}'s all-gather started after unit {i} began "
                           "computing: start it in unit i's pre-hook (_prefetch(unit, +1))")
                backward = ev[last_forward + 1:]
                for i in range(units - 1, 0, -1):
                    expect(("gather", i - 1) in backward and ("reduce-scatter", i) in backward
                           and backward.index(("gather", i - 1)) < backward.index(("reduce-scatter", i)),
                           f"rank {r}: in backward, unit {i - 1}'s all-gather started after unit {i}'s "
                           "gradients were done: start it when backward reaches unit i (_prefetch(unit, -1))")
            return "one unit ahead: forward gathers unit i+1 while unit i computes, backward unit i-1"

        return [judged(match_line, matches), judged(order_line, order)]


# ---- 6. bf16 on the wire (no new code) ---------------------------------------------------------

class Bf16Task(Task):
    name, answers, hang_hint = "bf16", ("ZeRO3",), HANG

    def cases(self) -> list[Case]:
        return [Case(2, ("bf16, 2 ranks: bf16 on the wire, 3Ψ·2·(N-1)/N",
                         "bf16, 2 ranks: fp32 shards close to one fp32 process"))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        return _drawn_batches(case, rng)

    def exercise(self, case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
        n, r = case.world_size, distlab.rank()
        model = build_model(PRESET)
        zero = ZeRO3(model, optimizer=make_opt, gather_dtype=torch.bfloat16)
        stats = []
        for step in range(STEPS):
            distlab.engine.runtime.progress(f"gather_dtype=bfloat16, {n} ranks, step {step}")
            x, y = _my_batch(step, n, r, inputs)
            with track_comm() as comm:
                lm_loss(zero, x, y).backward()
            zero.optimizer.step()
            zero.optimizer.zero_grad(set_to_none=True)
            stats.append(comm.stats())          # every step whose values count
        return {"params": full_params(model, zero.units), "comm": stats, "padded": [u.padded for u in zero.units],
                "shard_dtypes": sorted({str(u.shard.dtype) for u in zero.units})}

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        return _trained(inputs)

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        n = case.world_size
        wire_line, values_line = case.lines

        def wire() -> str:
            for r, out in enumerate(outputs):
                _traffic_per_step(out["comm"], len(out["padded"]), sum(out["padded"]), n, 2, f"rank {r}")
            return "2-byte elements in every all-gather and reduce-scatter"

        def values() -> str:
            for r, out in enumerate(outputs):
                expect(out["shard_dtypes"] == ["torch.float32"], f"rank {r}: shards in {out['shard_dtypes']}; "
                       "the shards (and the optimizer) stay fp32")
            # bf16 rounds the gathered weights and the summed gradients: 8 bits of precision.
            _compare_params(outputs, "params", reference, 5e-2, 0, "gather_dtype=bfloat16")
            return "bf16 gathers and gradients, fp32 shards within 0.05 of one fp32 process"

        return [judged(wire_line, wire), judged(values_line, values)]


TASKS = {t.name: t for t in (ShardTask(), ForwardTask(), BackwardTask(), TrainTask(), PrefetchTask(), Bf16Task())}

grade = grader(TASKS)
