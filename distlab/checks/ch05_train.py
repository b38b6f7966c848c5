"""Lab 5's tasks 4-6: training with async reduce-scatters, prefetch, and bf16 on the wire. `ch05` lists them."""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import expect
from distlab.meters import held_bytes, track_comm, track_memory
from distlab.course.models import build_model, lm_loss
from distlab.course.zero.units import block_units, full_params, whole_model_unit
from distlab.checks.ch05_common import (PRESET, STEPS, _batch, _compare_params, _drawn_batches,
                                        _my_batch, _traffic_per_step, _trained, make_opt)


# ---- 4. train: async reduce-scatter into the shards --------------------------------------------

VARIANTS = {"per-block units": dict(units=block_units), "whole model as one unit": dict(units=whole_model_unit)}


def _warm_up() -> None:
    """One forward and backward of a plain model on this rank's device, before memory is tracked: on
    a GPU the allocator and cuBLAS's workspace exist from then on."""
    model = build_model(PRESET)
    x, y = _batch(0, 1, 0)
    lm_loss(model, x, y).backward()


def train_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return _drawn_batches(case, rng)


def train_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
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


def train_reference(case: Case, inputs: list | None = None) -> dict:
    return _trained(inputs)


def train_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
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

    return [check_line(block_line, matches("per-block units")), check_line(whole_line, matches("whole model as one unit")),
            check_line(traffic_line, traffic), check_line(only_line, only)]


# ---- 5. prefetch ---------------------------------------------------------------------------------


def prefetch_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return _drawn_batches(case, rng)


def prefetch_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
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
    log: list = []
    stats = _metered_steps(zero, n, r, inputs, "prefetch=True", after_first=lambda: log.extend(zero.events))
    return {"params": full_params(model, zero.units), "events": log, "comm": stats,
            "padded": [u.padded for u in zero.units]}


def _metered_steps(zero: Any, n: int, r: int, inputs: dict | None, what: str, after_first: Any = None) -> list:
    """STEPS training steps of `zero` on this rank's batches; each step's traffic (forward and backward), metered.
    `after_first`: called once step 0 is done."""
    stats = []
    for step in range(STEPS):
        distlab.engine.runtime.progress(f"{what}, {n} ranks, step {step}")
        x, y = _my_batch(step, n, r, inputs)
        with track_comm() as comm:
            lm_loss(zero, x, y).backward()
        zero.optimizer.step()
        zero.optimizer.zero_grad(set_to_none=True)
        stats.append(comm.stats())          # every step whose values count
        if step == 0 and after_first is not None:
            after_first()
    return stats


def prefetch_reference(case: Case, inputs: list | None = None) -> dict:
    return _trained(inputs)


def prefetch_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
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

    return [check_line(match_line, matches), check_line(order_line, order)]


# ---- 6. bf16 on the wire (no new code) ---------------------------------------------------------


def bf16_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return _drawn_batches(case, rng)


def bf16_exercise(case: Case, ZeRO3: Any, inputs: dict | None = None) -> dict:
    n, r = case.world_size, distlab.rank()
    model = build_model(PRESET)
    zero = ZeRO3(model, optimizer=make_opt, gather_dtype=torch.bfloat16)
    stats = _metered_steps(zero, n, r, inputs, "gather_dtype=bfloat16")
    return {"params": full_params(model, zero.units), "comm": stats, "padded": [u.padded for u in zero.units],
            "shard_dtypes": sorted({str(u.shard.dtype) for u in zero.units})}


def bf16_reference(case: Case, inputs: list | None = None) -> dict:
    return _trained(inputs)


def bf16_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
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

    return [check_line(wire_line, wire), check_line(values_line, values)]
