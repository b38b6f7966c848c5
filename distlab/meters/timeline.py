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
        from distlab.runtime import rank as current_rank
        self.rank = current_rank() if rank is None else rank
        self.device = device
        self.spans: list[Span] = []
        self._pending: list[Any] = []   # CUDA: (name, start event, wall clock at start)
        self._events: list[Any] = []    # CUDA: (name, start event, end event)

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

        On CUDA: from an event recorded now to one recorded, on the current
        stream, after the stream waits for the work (in the returned object's
        `wait()`); call `finish()` before reading `spans`.

        Where the backend offers a future, its callback stamps the end on the
        thread that completes the work, so waiting later does not stretch the
        span. gloo's all_gather_single / reduce_scatter_single works have no
        future (torch 2.13): then the end is stamped when `wait()` returns, an
        upper bound. Use the returned object in place of `work`.
        """
        if self._cuda():
            import torch
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending.append((name, begin, time.perf_counter()))
            return _StampOnWait(work, lambda: self._cuda_end(name, begin))
        start = time.perf_counter()
        try:
            future = work.get_future()
        except RuntimeError:
            return _StampOnWait(work, lambda: self.add(name, "comm", start, time.perf_counter()))
        future.add_done_callback(lambda _f: self.add(name, "comm", start, time.perf_counter()))
        return work

    def _cuda(self) -> bool:
        import torch
        dev = self.device
        if dev is None:
            from distlab.runtime import device as rank_device
            dev = rank_device()
        return torch.device(dev).type == "cuda"

    def _cuda_end(self, name: str, begin: Any) -> None:
        import torch
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # after wait(): the current stream now depends on the collective
        self._events.append((name, begin, end))

    def finish(self) -> list["Span"]:
        """On CUDA, turn recorded event pairs into spans (synchronises); return `spans`."""
        if self._events:
            import torch
            torch.cuda.synchronize()
            for name, begin, end in self._events:
                wall = next((w for n, b, w in self._pending if b is begin), None)
                if wall is not None:
                    self.add(name, "comm", wall, wall + begin.elapsed_time(end) / 1e3)
            self._events.clear()
            self._pending.clear()
        return self.spans


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
    Times are seconds on the profiler's clock, which ranks on one machine share.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from distlab.runtime import device as rank_device
    from distlab.runtime import rank as current_rank
    r = current_rank() if rank is None else rank
    on_cuda = rank_device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync()
    prof = profile(activities=activities)
    with _native_stderr_silenced():   # kineto prints a timestamped line at every start and stop
        prof.__enter__()
    try:
        step()
        sync()
    finally:
        with _native_stderr_silenced():
            prof.__exit__(None, None, None)
    spans = []
    gpu_labels = set()
    if on_cuda:
        for e in prof.events():
            if _on_device(e) and e.name.startswith(compute_prefixes):
                gpu_labels.add(e.name)
    for e in prof.events():
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
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


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null inside the block (C++ libraries write there directly)."""
    import os
    import sys
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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
