"""Wall time per phase, with device synchronisation, and throughput.

CUDA kernels run asynchronously: without `torch.cuda.synchronize` a timer
measures how fast work was queued, not how fast it ran. `sync` is a no-op
on the CPU.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (CUDA); nothing to wait for on the CPU."""
    if device is None:
        from distlab.engine.runtime import device as rank_device
        device = rank_device()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates seconds per named phase: `with timer.phase("backward"): ...`."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.counts[name] += 1

    def mean(self, name: str) -> float:
        return self.seconds[name] / max(self.counts[name], 1)


@dataclass(frozen=True)
class Throughput:
    samples_per_s: float
    tokens_per_s: float


def throughput(samples: int, seconds: float, tokens_per_sample: int = 1) -> Throughput:
    """Samples/s and tokens/s for `samples` processed in `seconds` (all ranks together)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return Throughput(samples / seconds, samples * tokens_per_sample / seconds)


def time_call(fn, *, repeats: int, warmup: int = 1, device: torch.device | str | None = None) -> list[float]:
    """Seconds for each of `repeats` calls of `fn()`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out
