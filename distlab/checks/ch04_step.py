"""Lab 4's tasks 4-5: ZeRO2.step and zero_grad against one process, and the memory a rank holds. `ch04` lists them."""
from __future__ import annotations

import functools
from typing import Any

import torch

import distlab
from distlab.checks.draws import drawn_batch_shards, full_batches
from distlab.checks.task import Case, Line, check_line, on_one_rank
from distlab.checks.verdict import CheckFailed, compare, expect
from distlab.meters import held_bytes, model_state, track_comm, track_memory
from distlab.course.models import PRESETS, lm_loss, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.theory import comm_bytes_per_rank
from distlab.checks.ch04_common import (BATCH, BUCKET_MB, RECIPES, STEPS, TOL,
                                        _my_batch, _params, _rank_batch, variant_model)


# ---- 4. step, zero_grad --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def train_single(variant: str, recipe: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The ground truth: one process (CPU), the whole batch, the plain optimizer."""
    opt_class, kw, dtype = RECIPES[recipe]
    model = variant_model(variant, dtype=dtype, device="cpu")
    opt = opt_class([p for p in model.parameters() if p.requires_grad], **kw)
    for step in range(steps):
        x, y = synthetic_batch(step, BATCH, PRESETS["tiny"], device="cpu")
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _params(model)


def _train_on(variant: str, recipe: str, batches: list) -> dict[str, torch.Tensor]:
    """`train_single` on given (drawn) whole batches."""
    opt_class, kw, dtype = RECIPES[recipe]
    model = variant_model(variant, dtype=dtype, device="cpu")
    opt = opt_class([p for p in model.parameters() if p.requires_grad], **kw)
    for x, y in batches:
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _params(model)


def _trained_configs(configs: tuple, batches: list | None) -> dict:
    """Each (recipe, variant) trained in one process: on the package's batches, or on the drawn ones."""
    if batches is None:
        return {(recipe, v): train_single(v, recipe) for recipe, v in configs}
    return {(recipe, v): _train_on(v, recipe, batches) for recipe, v in configs}


def step_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of each step's batch."""
    return drawn_batch_shards(rng, case.world_size, STEPS, BATCH)


def step_exercise(case: Case, ZeRO2: Any, inputs: dict | None = None) -> dict:
    n, r, out = case.world_size, distlab.rank(), {}
    for recipe, variant in case.args["configs"]:
        opt_class, kw, dtype = RECIPES[recipe]
        model = variant_model(variant, dtype=dtype)
        opt = ZeRO2(model.parameters(), opt_class, bucket_size_mb=BUCKET_MB, **kw)
        for step in range(STEPS):
            distlab.engine.runtime.progress(f"{recipe}, {variant} weights, {n} ranks, step {step}")
            x, y = _my_batch(step, n, r, inputs)
            # every step whose parameters the values line judges is metered, and its traffic judged
            with track_comm() as in_backward:
                lm_loss(model, x, y).backward()
            with track_comm() as in_step:
                opt.step()
                opt.zero_grad(set_to_none=True)
            out.setdefault((recipe, variant, "comm"), []).append((in_backward.stats(), in_step.stats()))
        out[recipe, variant, "buckets"] = len(opt.buckets)
        out[recipe, variant, "optimizer_state"] = model_state([], grads=[], optimizer=opt.optim).optimizer_state
        out[recipe, variant] = _params(model)
    return out


def step_reference(case: Case, inputs: list | None = None) -> dict:
    configs = tuple(case.args["configs"])
    out = on_one_rank(_trained_configs, configs, None if inputs is None else full_batches(inputs, STEPS))
    for v in ("frozen", "tied"):
        model = variant_model(v, device="cpu")
        trainable = [p for p in model.parameters() if p.requires_grad]
        out[v, "psi"] = (sum(p.numel() for p in trainable), max(p.numel() for p in trainable), len(trainable))
    return out


def step_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n = case.world_size
    match_line, state_line, comm_line = case.lines

    def matches() -> str:
        for r, out in enumerate(outputs):
            for recipe, variant in case.args["configs"]:
                atol, rtol = TOL[recipe]
                ref = reference[recipe, variant]
                mine = out[recipe, variant]
                expect(mine.keys() == ref.keys(), f"rank {r} returned different parameter names")
                for k in ref:
                    try:
                        compare(mine[k], ref[k], atol=atol, rtol=rtol, what=f"rank {r}'s {k}")
                    except CheckFailed as exc:
                        raise CheckFailed(f"{recipe}, {variant} weights, after {STEPS} steps: {exc}")
        return f"the same parameters as one process on the whole batch after {STEPS} steps"

    def state() -> str:
        for variant in ("tied",):
            psi, largest, count = reference[variant, "psi"]
            owned = []
            for r, out in enumerate(outputs):
                b = out["MixedPrecisionAdam", variant, "optimizer_state"]
                expect(b % 12 == 0, f"rank {r}, {variant} weights: {b} B of optimizer state is not "
                       "12 B (fp32 master + m + v) per parameter")
                owned.append(b // 12)
                expect(owned[-1] <= psi / n + largest, f"rank {r}, {variant} weights: optimizer state for "
                       f"{owned[-1]} parameters; its share is about {psi / n:.0f}")
            expect(psi <= sum(owned) < psi + n * count, f"{variant} weights: the ranks together keep state "
                   f"for {sum(owned)} parameters; expected each of the {psi} trainable parameters once")
        return "12 B x its own chunks on each rank; together every trainable parameter once"

    def traffic() -> str:
        # every recipe's every step: the values line judges the parameters they made
        for recipe, variant in case.args["configs"]:
            b = RECIPES[recipe][2].itemsize
            want = comm_bytes_per_rank(reference[variant, "psi"][0], n, stage=2, bytes_per_element=b)
            for r, out in enumerate(outputs):
                buckets, steps = out[recipe, variant, "buckets"], out[recipe, variant, "comm"]
                at = f"rank {r}, {recipe}, {variant} weights"
                expect(len(steps) == STEPS, f"{at}: {len(steps)} metered steps, expected {STEPS}")
                for k, (back, step) in enumerate(steps):
                    rs, ag = back.calls.get("reduce_scatter", 0), step.calls.get("all_gather", 0)
                    expect(set(back.calls) == {"reduce_scatter"} and rs == buckets,
                           f"{at}: during backward (step {k}) expected {buckets} reduce-scatters (one per "
                           f"bucket), saw {back.calls}")
                    expect(set(step.calls) == {"all_gather"} and ag == buckets,
                           f"{at}: during step() and zero_grad() (step {k}) expected {buckets} all-gathers "
                           f"(one per bucket), saw {step.calls}")
                    total, slack = back.total_bytes + step.total_bytes, 2 * buckets * n * b   # padding: < N a bucket
                    expect(abs(total - want) <= slack, f"{at}: sent {total} algorithmic bytes in step {k}; "
                           f"expected 2Ψb(N-1)/N = {want:.0f}")
        return "one reduce-scatter and one all-gather per bucket, 2Ψb(N-1)/N algorithmic bytes per step"

    return [check_line(match_line, matches), check_line(state_line, state), check_line(comm_line, traffic)]


# ---- 5. memory (no new code) ---------------------------------------------------------------------

MEM_PRESET, MEM_SEQ, MEM_BUCKET_MB = "small", 8, 0.25


def memory_exercise(case: Case, ZeRO2: Any) -> dict:
    n, r = case.world_size, distlab.rank()
    distlab.engine.runtime.progress(f"bf16 + MixedPrecisionAdam, held bytes after two steps, {n} ranks")
    model = variant_model("plain", dtype=torch.bfloat16)
    opt = ZeRO2(model.parameters(), MixedPrecisionAdam, bucket_size_mb=BUCKET_MB, lr=1e-3)
    for step in range(2):
        x, y = _rank_batch(step, n, r)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    held = held_bytes(model, vars(opt))
    padded = sum(b.numel for b in opt.buckets)
    # The gradient high-water mark, in fp32 (weights used as stored: no compute-dtype copies in
    # the activations): what a rank held beyond parameters and optimizer state at its worst moment.
    model = variant_model("plain", MEM_PRESET, seq_len=MEM_SEQ)
    opt = ZeRO2(model.parameters(), torch.optim.SGD, bucket_size_mb=MEM_BUCKET_MB, lr=0.1, momentum=0.9)

    def step(s: int) -> None:
        x, y = _rank_batch(s, n, r, MEM_PRESET, batch=n)
        lm_loss(model, x[:, :MEM_SEQ], y[:, :MEM_SEQ]).backward()
        opt.step()
        opt.zero_grad()

    distlab.engine.runtime.progress(f"fp32 + SGD on '{MEM_PRESET}', warm-up step, {n} ranks")
    step(0)   # optimizer state exists; on a GPU the allocator and cuBLAS are warm
    at_rest = held_bytes(model, vars(opt))
    states = model_state(model, grads=[], optimizer=opt.optim)
    with track_memory() as mem:
        distlab.engine.runtime.progress(f"fp32 + SGD on '{MEM_PRESET}', tracked step, {n} ranks")
        step(1)
    return {"held": held, "padded": padded, "buckets": len(opt.buckets),
            "extra": at_rest + mem.peak_bytes - states.params - states.optimizer_state}


def memory_reference(case: Case) -> dict:
    tiny = variant_model("plain", device="cpu")
    small = variant_model("plain", MEM_PRESET, seq_len=MEM_SEQ, device="cpu")
    return {"psi": sum(p.numel() for p in tiny.parameters()), "count": len(list(tiny.parameters())),
            "full_grad": 4 * sum(p.numel() for p in small.parameters())}


def memory_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n, psi = case.world_size, reference["psi"]
    states_line, peak_line = case.lines

    def states() -> str:
        for r, out in enumerate(outputs):
            padded = out["padded"]
            expect(psi <= padded < psi + n * reference["count"], f"rank {r}: buckets of {padded} elements "
                   f"for Ψ = {psi} parameters")
            want = 2 * padded + 14 * padded // n
            expect(out["held"] == want, f"rank {r} holds {out['held']:,} B between steps (model, optimizer "
                   f"and everything it keeps); expected 2Ψ + 14Ψ/N = {want:,} B (Ψ = {padded} with padding)")
        return "exactly bf16 parameters, plus bf16 gradient and fp32 Adam chunks of 1/N"

    def peak() -> str:
        for r, out in enumerate(outputs):
            expect(out["extra"] < reference["full_grad"],
                   f"rank {r} held {out['extra']:,} B beyond parameters and optimizer state at its peak; "
                   f"a full fp32 gradient is {reference['full_grad']:,} B")
        return "gradients and activations in flight stay below one full gradient on every rank"

    return [check_line(states_line, states), check_line(peak_line, peak)]
