"""The alternating race: implementations timed side by side, in one run, on the same ranks.

    def step_ours(): ...        # one training step of each implementation
    def step_torch(): ...
    result = race({"ours": step_ours, "torch DDP": step_torch}, repeats=41, budget_s=120)
    result.ratio("ours", "torch DDP")      # median of the paired per-repeat ratios

Runs on every rank (inside a launched function). Each repeat runs every
implementation once, in a rotated order, so a noisy neighbour on a shared
machine slows all of them alike. Each timed call starts after a barrier and a
device sync and ends after a device sync (`distlab.meters.sync`): on a GPU
the time is that of the kernels, not of queueing them. The time of a call is
the slowest rank's (a step is done when the last rank is).

`budget_s` caps the time a race may take: after at least `min_repeats`,
it stops once the budget is spent (every rank decides alike, from the same
all-reduced times). So a slow laptop runs fewer repeats instead of running
for an hour; the result says how many ran.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from distlab.meters.timing import sync


@dataclass(frozen=True)
class RaceResult:
    """Seconds per call of each implementation, repeat by repeat (slowest rank's time)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    budget_hit: bool = False

    @property
    def repeats(self) -> int:
        return min((len(v) for v in self.seconds.values()), default=0)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def per_second(self, name: str, items: float) -> float:
        """Throughput: `items` (samples, tokens) per call / median seconds."""
        return items / self.median(name)

    def ratios(self, name: str, baseline: str) -> list[float]:
        """Per-repeat speed ratios (baseline time / this time): > 1 means `name` is faster."""
        return [b / a for a, b in zip(self.seconds[name], self.seconds[baseline])]

    def ratio(self, name: str, baseline: str) -> float:
        """Median of the paired ratios: the speed of `name` relative to `baseline`."""
        return statistics.median(self.ratios(name, baseline))

    def spread(self, name: str, baseline: str) -> tuple[float, float]:
        """(25th, 75th) percentile of the paired ratios: the noise around `ratio`."""
        r = sorted(self.ratios(name, baseline))
        if len(r) < 4:
            return (r[0], r[-1])
        q = statistics.quantiles(r, n=4)
        return (q[0], q[2])

    def describe(self, name: str, baseline: str) -> str:
        lo, hi = self.spread(name, baseline)
        return f"{self.ratio(name, baseline):.2f}x {baseline} (middle half of {self.repeats} repeats: {lo:.2f}-{hi:.2f}x)"

    def record(self, name: str, baseline: str, **fields: object) -> dict:
        """Write the ratio of `name` to `baseline` as a `races` record for the tour's report
        (call it in the notebook, on the result a rank returned)."""
        from distlab.meters.records import record
        lo, hi = self.spread(name, baseline)
        return record("races", name=name, baseline=baseline, ratio=self.ratio(name, baseline), spread_lo=lo,
                      spread_hi=hi, repeats=self.repeats, budget_hit=self.budget_hit,
                      seconds=self.median(name), baseline_seconds=self.median(baseline), **fields)


def timed(fn: Callable[[], Any], device: Any = None) -> float:
    """Seconds for one call of `fn`, barrier and device sync before, device sync after; slowest rank's."""
    if dist.is_initialized():
        dist.barrier()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    elapsed = time.perf_counter() - start
    if dist.is_initialized() and dist.get_world_size() > 1:
        from distlab.engine.runtime import device as rank_device
        t = torch.tensor([elapsed], dtype=torch.float64, device=device or rank_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        elapsed = t.item()
    return elapsed


def race(impls: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1, budget_s: float | None = None,
         min_repeats: int = 3, device: Any = None) -> RaceResult:
    """Time each implementation `repeats` times, alternating; stop early past `budget_s` seconds.

    `impls`: name -> a function running one unit of work (a training step).
    Warm-up calls (lazy initialisation, allocator, optimizer state) are not timed.
    """
    if not impls:
        raise ValueError("race needs at least one implementation")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(impls)
    for _ in range(warmup):
        for name in names:
            impls[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    spent, hit = 0.0, False
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = timed(impls[name], device)
            seconds[name].append(t)
            spent += t
        if budget_s is not None and r + 1 >= min_repeats and spent > budget_s and r + 1 < repeats:
            hit = True
            break
    return RaceResult(seconds, hit)
