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

        Where the backend offers a future, its callback stamps the end on the
        thread that completes the work, so waiting later does not stretch the
        span. gloo's all_gather_single / reduce_scatter_single works have no
        future (torch 2.13): then the end is stamped when `wait()` returns, an
        upper bound. Use the returned object in place of `work`.
        """
        start = time.perf_counter()
        try:
            future = work.get_future()
        except RuntimeError:
            return _StampOnWait(work, lambda: self.add(name, "comm", start, time.perf_counter()))
        future.add_done_callback(lambda _f: self.add(name, "comm", start, time.perf_counter()))
        return work


class _StampOnWait:
    """A `Work` whose `wait()` also records when it returned (once)."""

    def __init__(self, work: Any, stamp: Any) -> None:
        self._work, self._stamp = work, stamp

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._stamp is not None:
            self._stamp()
            self._stamp = None
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
