"""What lab 5's tasks share: the model, the batches (seeded, or drawn under grading), a single process's
training, and the traffic checks."""
from __future__ import annotations

import functools
from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_batch_shards, drawn_weights, full_batches, load_weights
from distlab.checks.task import Case, on_one_rank
from distlab.checks.verdict import CheckFailed, compare, expect
from distlab.course.models import build_model, lm_loss, split_batch, synthetic_batch
from distlab.course.zero.units import block_units


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
    """One process trained on the whole batch, computed on a rank (`on_one_rank`)."""
    if inputs is None:
        return _train_single_on_a_rank()
    return on_one_rank(_train_on, full_batches(inputs, STEPS))


@functools.lru_cache(maxsize=None)
def _train_single_on_a_rank() -> dict[str, torch.Tensor]:
    return on_one_rank(_train_single)


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
