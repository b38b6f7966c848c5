"""Per-rank spans of compute and communication, for a Gantt chart.

Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux), which every
process on one machine shares, so spans from different ranks line up.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from distlab.meters.timing import sync


@dataclass(frozen=True)
class Span:
    rank: int
    name: str
    kind: str  # "compute" or "comm"
    start: float
    end: float


class Timeline:
    """Collects spans on one rank. Picklable: return `timeline.spans` from a rank."""

    def __init__(self, rank: int | None = None, device: Any = None) -> None:
        from distlab.rank import rank as current_rank
        self.rank = current_rank() if rank is None else rank
        self.device = device
        self.spans: list[Span] = []

    def add(self, name: str, kind: str, start: float, end: float) -> None:
        if kind not in ("compute", "comm"):
            raise ValueError(f"kind must be 'compute' or 'comm', got {kind!r}")
        self.spans.append(Span(self.rank, name, kind, start, end))

    @contextmanager
    def span(self, name: str, kind: str = "compute") -> Iterator[None]:
        """Time a blocking region (synchronised on CUDA)."""
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.add(name, kind, start, time.perf_counter())

    def track(self, name: str, work: Any) -> Any:
        """Record an async collective from now until its `Work` completes.

        The end is stamped by the work's future callback, on the thread that
        completes it, so waiting later does not stretch the span.
        """
        start = time.perf_counter()
        work.get_future().add_done_callback(
            lambda _f: self.add(name, "comm", start, time.perf_counter()))
        return work
