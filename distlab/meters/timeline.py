"""Per-rank spans of compute and communication, for a Gantt chart.

Two ways to get them:

- `Timeline`: spans the code records itself (`with tl.span(...)`,
  `tl.track(name, work)`). Times are `time.perf_counter()` (CLOCK_MONOTONIC
  on Linux), which every process on one machine shares, so spans from
  different ranks line up. On CPU ranks (gloo) a collective runs on gloo's
  thread and its `Work` completes when the bytes have moved, so `track` sees
  the real span. On GPUs it does not: NCCL works complete when queued and
  kernels run later, so on CUDA `track` records a CUDA event pair on the
  current stream and its span is read after a sync (`finish()`).
- `profile_spans(step)`: runs `step()` under the PyTorch profiler and reads
  the spans from it: on CPU the `gloo:*` operations, on CUDA the NCCL kernels
  (`nccl*`) and, for compute, the GPU side of the `record_function` ranges
  the step opened. This is the view to trust on a GPU.
"""
from __future__ import annotations

import os
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
    """Collects spans on one rank. Picklable: return `timeline.finish()` (a list of spans) from a rank.

    On CUDA no span syncs the device (a device-wide sync would fold the
    communication into the compute span it overlaps): spans are CUDA event
    pairs on the current stream, turned into times by `finish()`, on the
    wall clock of a reference event recorded when the timeline started.
    """

    def __init__(self, rank: int | None = None, device: Any = None) -> None:
        from distlab.engine.runtime import rank as current_rank
        self.rank = current_rank() if rank is None else rank
        self.device = device
        self.spans: list[Span] = []
        self._events: list[Any] = []    # CUDA: (name, kind, start event, end event or None)
        self._origin: Any = None        # CUDA: (reference event, wall clock at that event)

    def add(self, name: str, kind: str, start: float, end: float) -> None:
        if kind not in ("compute", "comm"):
            raise ValueError(f"kind must be 'compute' or 'comm', got {kind!r}")
        self.spans.append(Span(self.rank, name, kind, start, end))

    # -- CUDA events ------------------------------------------------------------------------------
    def _cuda(self) -> bool:
        import torch
        dev = self.device
        if dev is None:
            from distlab.engine.runtime import device as rank_device
            dev = rank_device()
        return torch.device(dev).type == "cuda"

    def _event(self) -> Any:
        import torch
        if self._origin is None:
            sync(self.device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            self._origin = (ref, time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self) -> list[Span]:
        """On CUDA, wait for the device and turn recorded event pairs into spans; return `spans`."""
        if self._events:
            sync(self.device)
            ref, wall = self._origin
            for name, kind, begin, end in self._events:
                if end is not None:
                    self.add(name, kind, wall + ref.elapsed_time(begin) / 1e3, wall + ref.elapsed_time(end) / 1e3)
            self._events.clear()
        return self.spans

    # -- recording ---------------------------------------------------------------------------------
    @contextmanager
    def span(self, name: str, kind: str = "compute") -> Iterator[None]:
        """Time a region: wall clock on CPU; CUDA events on the current stream on a GPU."""
        if self._cuda():
            entry = [name, kind, self._event(), None]
            try:
                yield
            finally:
                entry[3] = self._event()
                self._events.append(tuple(entry))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, kind, start, time.perf_counter())

    def track(self, name: str, work: Any) -> Any:
        """Record an async collective from now until its `Work` completes; use the returned object
        in place of `work`.

        CPU (gloo): the collective runs on gloo's thread; where the backend
        offers a future, its callback stamps the end when the bytes have
        moved, so waiting later does not stretch the span. gloo's
        all_gather_single / reduce_scatter_single works have no future (torch
        2.13): then the end is stamped when `wait()` returns, an upper bound.
        CUDA (NCCL): the work completes when queued, so the span runs from an
        event recorded now to one recorded on the current stream right after
        it waits for the collective (an upper bound too); `finish()` reads it.
        """
        if self._cuda():
            begin = self._event()
            return _StampOnWait(work, lambda: self._events.append((name, "comm", begin, self._event())))
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


def profile_spans(step: Any, *, compute_prefixes: tuple[str, ...] = ("fwd", "bwd", "forward", "backward"),
                  rank: int | None = None) -> list[Span]:
    """Run `step()` once under the PyTorch profiler; return its compute and comm spans on this rank.

    Compute spans are the `record_function` ranges whose names start with one
    of `compute_prefixes` (on CUDA, their GPU side when the profiler has it);
    comm spans are gloo's operations on CPU ranks and NCCL's kernels on GPUs.
    Times are seconds on `time.perf_counter()`'s clock, as `Timeline`'s are: ranks on one machine share
    it, so one rank's spans line up with another's even when their profilers started at different times
    (the profiler's own event times count from each process's trace start).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from distlab.engine.runtime import device as rank_device
    from distlab.engine.runtime import rank as current_rank
    r = current_rank() if rank is None else rank
    on_cuda = rank_device().type == "cuda"
    # Kineto prints 'USDT: ... profiler_start/stop' on stderr at every profile unless its log level
    # is above USDT (5); it reads this when the profiler first starts in the process.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync()
    with profile(activities=activities) as prof:
        step()
        sync()
    # Event times are microseconds from this process's trace start, which the profiler keeps in Unix-epoch
    # nanoseconds; shift them onto perf_counter's clock, read against the wall clock now.
    origin = prof.profiler.kineto_results.trace_start_ns() / 1e9 + (time.perf_counter() - time.time())
    spans = []
    gpu_labels = set()
    if on_cuda:
        for e in prof.events():
            if _on_device(e) and e.name.startswith(compute_prefixes):
                gpu_labels.add(e.name)
    for e in prof.events():
        start, end = origin + e.time_range.start / 1e6, origin + e.time_range.end / 1e6
        if on_cuda:
            if _on_device(e) and "nccl" in e.name.lower():
                spans.append(Span(r, _nccl_name(e.name), "comm", start, end))
            elif e.name.startswith(compute_prefixes) and (_on_device(e) or e.name not in gpu_labels):
                spans.append(Span(r, e.name, "compute", start, end))
        elif e.name.startswith("gloo:"):
            spans.append(Span(r, e.name[len("gloo:"):], "comm", start, end))
        elif e.name.startswith(compute_prefixes):
            spans.append(Span(r, e.name, "compute", start, end))
    del torch
    return spans


def _on_device(event: Any) -> bool:
    from torch.autograd import DeviceType
    return getattr(event, "device_type", None) == DeviceType.CUDA


def _nccl_name(kernel: str) -> str:
    """'ncclDevKernel_AllGather_RING_LL(...)' -> 'AllGather'."""
    name = kernel.split("(")[0]
    for part in name.replace("ncclDevKernel_", "").replace("ncclKernel_", "").split("_"):
        if part:
            return part
    return name
