"""Measuring a data-parallel strategy: what a rank holds, what it sends, how fast it trains.

Chapters 2 and 3 (and their labs) compare hand-written strategies with
PyTorch's on the same model, the same batches and the same meters:

    def build(name, model):                       # in the notebook
        if name == "ddp":
            return Strategy(TorchDDP(model), MixedPrecisionAdam(model.parameters(), lr=1e-3))
        ...

    out = distlab.launch(measure, 2, args=(build, "ddp"), kwargs=dict(preset="small", dtype=torch.bfloat16,
                         batch_size=8, steps=2))        # model states, peak, traffic, parameters
    res = distlab.launch(race_strategies, 2, args=(build, ["ddp", "zero1"]), kwargs=dict(preset="small",
                         dtype=torch.bfloat16, batch_size=8, repeats=21, budget_s=30))[0]

Everything is placed on the rank's device; times come from `distlab.bench.race`
(barrier and device sync around every timed step); memory from `track_memory`
and `model_state` (exact on every device); traffic from `track_comm`
(algorithmic bytes). `record_strategy` writes the record the tour reads (a race
records itself: `RaceResult.record`).

Sweeps over N stay on one backend (`sweep_world_sizes`): a figure never
mixes NCCL points (allocator bytes, GPU time) with gloo points.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from distlab.engine import runtime as rt
from distlab.meters.records import record
from distlab.bench.race import RaceResult, race
from distlab.meters import model_state, track_comm, track_memory
from distlab.course.models import PRESETS, build_model, lm_loss, split_batch, synthetic_batch


# ---- which world sizes, which backend ----------------------------------------------------------------

def backend_for(world_size: int) -> str:
    """The backend `distlab.launch` picks for `world_size` ranks on this machine (without launching)."""
    from distlab.engine.launch import gpu_count
    if gpu_count() >= world_size and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def ranks_label(world_size: int) -> str:
    """'2 CPU ranks with gloo' or '2 GPUs with NCCL': what a figure's title says about its points."""
    if backend_for(world_size) == "nccl":
        return f"{world_size} GPU{'s' if world_size > 1 else ''} with NCCL"
    return f"{world_size} CPU rank{'s' if world_size > 1 else ''} with gloo"


def sweep_world_sizes(n_max: int, candidates: Sequence[int] = (1, 2, 4, 8)) -> list[int]:
    """The world sizes of a sweep up to `n_max` (always included) that run on `n_max`'s backend.

    With 2 GPUs and n_max = 4, the 4 ranks fall back to gloo; the 1- and 2-rank
    points would run on NCCL, so they are left out rather than mixed in.
    """
    if n_max < 1:
        raise ValueError(f"n_max must be at least 1, got {n_max}")
    sizes = sorted({n for n in candidates if n <= n_max} | {n_max})
    return [n for n in sizes if backend_for(n) == backend_for(n_max)]


def global_batch(world_sizes: Sequence[int], target: int = 16) -> int:
    """A global batch that splits evenly over every world size in the sweep, close to `target`."""
    step = math.lcm(*world_sizes)
    return step * max(1, round(target / step))


# ---- one strategy on a rank ----------------------------------------------------------------------------

@dataclass
class Strategy:
    """How one data-parallel strategy trains, as the measurements drive it.

    module: what forward runs (a wrapper, or the model itself);
    optimizer: what `step()` and `zero_grad()` are called on;
    finish: called between `backward()` and `step()` (the labs' DDP wrappers), or None;
    state_of: the optimizer whose `state` holds this rank's optimizer states
      (PyTorch's ZeroRedundancyOptimizer keeps them in `.optim`); default `optimizer`.
    """

    module: torch.nn.Module
    optimizer: Any
    finish: Callable[[], Any] | None = None
    state_of: Any = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        lm_loss(self.module, x, y).backward()
        if self.finish is not None:
            self.finish()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


Split = Callable[[tuple[torch.Tensor, ...], int, int], tuple[torch.Tensor, ...]]


def _batch(step: int, batch_size: int, preset: str, split: Split | None) -> tuple[torch.Tensor, ...]:
    # This rank's rows of the global batch: the notebook's own split when it passes one (lecture 2 shows it).
    return (split or split_batch)(synthetic_batch(step, batch_size, PRESETS[preset]), rt.rank(), rt.world_size())


def measure(build: Callable[[str, torch.nn.Module], Strategy], name: str, *, preset: str, dtype: torch.dtype,
            batch_size: int, steps: int = 3, timed: int = 0, budget_s: float | None = None,
            seed: int = 0, split: Split | None = None) -> dict[str, Any]:
    """On every rank: train strategy `name` for `steps` steps and report what it cost.

    Returns {"state": ModelState at the last step boundary (parameters,
    gradients and optimizer states alive), "peak": peak bytes allocated while
    building and training (activations included), "comm": CommStats of the
    last step (backward and optimizer step; take steps >= 3: DDP re-orders its
    buckets after its first step with a one-off broadcast), "params": parameters after
    `steps` steps (fp32), "seconds": median seconds of `timed` more steps run
    alone (barrier and device sync around each; None when timed=0)}.
    The global batch of `batch_size` rows is split over the ranks by `split(batch, rank, world_size)` (the
    lecture's own; default `distlab.course.models.split_batch`: contiguous slices of B/N rows).
    """
    with track_memory() as mem:
        model = build_model(preset, seed=seed).to(dtype)
        strategy = build(name, model)
        for step in range(steps):
            rt.progress(f"measuring {name}: step {step} of {steps}")
            x, y = _batch(step, batch_size, preset, split)
            with track_comm() as comm:
                strategy.step(x, y)
            if step == steps - 1:
                state = model_state(model, optimizer=strategy.state_of or strategy.optimizer)
            strategy.zero_grad()
        peak = mem.peak_bytes
    params = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    seconds = None
    if timed:
        rt.progress(f"timing {name} alone")

        def one_step() -> None:
            strategy.step(x, y)
            strategy.zero_grad()

        seconds = race({name: one_step}, repeats=timed, budget_s=budget_s).median(name)
    return {"state": state, "peak": peak, "comm": comm.stats(), "params": params, "seconds": seconds}


def race_strategies(build: Callable[[str, torch.nn.Module], Strategy], names: Sequence[str], *, preset: str,
                    dtype: torch.dtype, batch_size: int, repeats: int, budget_s: float | None = None,
                    seed: int = 0, split: Split | None = None) -> RaceResult:
    """On every rank: each strategy on its own copy of the model, one training step each,
    alternating (`distlab.bench.race`); the slowest rank's seconds per step. `split` as in `measure`."""
    built = {name: build(name, build_model(preset, seed=seed).to(dtype)) for name in names}
    x, y = _batch(0, batch_size, preset, split)

    def one(strategy: Strategy) -> Callable[[], None]:
        def step() -> None:
            strategy.step(x, y)
            strategy.zero_grad()
        return step

    rt.progress(f"racing {', '.join(names)}")
    return race({name: one(s) for name, s in built.items()}, repeats=repeats, budget_s=budget_s)


# ---- the tour's record ---------------------------------------------------------------------------------

def components(state: Any) -> dict[str, int]:
    """A ModelState as {params, grads, optimizer_state} bytes."""
    return {"params": state.params, "grads": state.grads, "optimizer_state": state.optimizer_state}


def max_param_diff(per_rank: Sequence[dict[str, Any]], reference: dict[str, torch.Tensor]) -> float:
    """Largest |parameter - reference| over every rank and every parameter."""
    return max((out["params"][k].float() - v.float()).abs().max().item() for out in per_rank for k, v in reference.items())


def record_strategy(name: str, *, world_size: int, num_params: int, recipe: str, preset: str,
                    measured: dict[str, Any], predicted_model_state_bytes: dict[str, float],
                    predicted_comm_bytes_per_step: float, samples_per_s: float,
                    max_abs_param_diff_vs_single: float, **extra: Any) -> dict[str, Any]:
    """One record in the tour's "strategies" section (rank 0's figures), with the backend it ran on."""
    return record(
        "strategies", name=name, world_size=world_size, num_params=num_params, recipe=recipe, preset=preset,
        backend=backend_for(world_size),
        model_state_bytes=components(measured["state"]), peak_bytes=measured["peak"],
        predicted_model_state_bytes=predicted_model_state_bytes,
        comm_bytes_per_step=measured["comm"].total_bytes, predicted_comm_bytes_per_step=predicted_comm_bytes_per_step,
        samples_per_s=samples_per_s, max_abs_param_diff_vs_single=max_abs_param_diff_vs_single, **extra)

