"""algbw/busbw of collectives vs message size, measured as nccl-tests does.

    records = sweep(world_size=4, sizes=[2**k for k in range(10, 27, 2)])

S is the whole message: the all-reduce buffer, the all-gather output, the
reduce-scatter input, the broadcast buffer. Each timing is the slowest
rank's (a collective is done when the last rank is), the median over
`repeats`; implementations alternate inside each repeat, so a noisy
neighbour hurts them alike.

A custom implementation is a function run on every rank with the same
arguments as the library call it replaces: `fn(tensor)` for all_reduce and
broadcast (root 0), `fn(output, input)` for all_gather and reduce_scatter.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from distlab import theory  # the package distlab.theory (not the facade)
from distlab.engine.collectives import all_gather_tensor, reduce_scatter_tensor
from distlab.engine.launch import run_on_ranks
from distlab.meters.timing import sync
from distlab.engine.runtime import device

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

LIBRARY: dict[str, Callable[..., Any]] = {
    "all_reduce": lambda t: dist.all_reduce(t),
    "all_gather": lambda out, inp: all_gather_tensor(out, inp),
    "reduce_scatter": lambda out, inp: reduce_scatter_tensor(out, inp),
    "broadcast": lambda t: dist.broadcast(t, 0),
}


def _buffers(op: str, nbytes: int, n: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    numel = max(n, (nbytes // 4) // n * n)  # float32, divisible by N
    if op == "all_gather":
        return torch.empty(numel, device=dev), torch.ones(numel // n, device=dev)
    if op == "reduce_scatter":
        return torch.empty(numel // n, device=dev), torch.ones(numel, device=dev)
    return (torch.ones(numel, device=dev),)


def _message_bytes(op: str, bufs: tuple[torch.Tensor, ...]) -> int:
    big = max(bufs, key=torch.Tensor.numel)
    return big.numel() * big.element_size()


def _timed(fn: Callable[..., Any], bufs: tuple[torch.Tensor, ...], dev: torch.device) -> float:
    dist.barrier()
    sync(dev)
    start = time.perf_counter()
    fn(*bufs)
    sync(dev)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides
    return elapsed.item()


def _rank_sweep(cases: list[tuple[str, str, Callable[..., Any]]], sizes: list[int],
                repeats: int, warmup: int) -> list[dict[str, Any]]:
    dev, n = device(), dist.get_world_size()
    out = []
    for nbytes in sizes:
        times: dict[tuple[str, str], list[float]] = {(op, impl): [] for op, impl, _ in cases}
        bufs = {(op, impl): _buffers(op, nbytes, n, dev) for op, impl, _ in cases}
        for i in range(warmup + repeats):
            for op, impl, fn in cases:
                t = _timed(fn, bufs[op, impl], dev)
                if i >= warmup:
                    times[op, impl].append(t)
        for op, impl, _ in cases:
            s = _message_bytes(op, bufs[op, impl])
            sec = statistics.median(times[op, impl])
            out.append({"op": op, "impl": impl, "world_size": n, "bytes": s, "seconds": sec,
                        "algbw_GBps": theory.algbw(s, sec) / 1e9,
                        "busbw_GBps": theory.busbw(op, s, sec, n) / 1e9})
    return out


def sweep(world_size: int, sizes: list[int], *, ops: tuple[str, ...] = OPS, repeats: int = 5,
          warmup: int = 1, custom: dict[tuple[str, str], Callable[..., Any]] | None = None,
          backend: str = "auto", timeout: float = 600) -> list[dict[str, Any]]:
    """One record per (op, impl, size): bytes, seconds, algbw_GBps, busbw_GBps.

    `custom` maps (op, impl_name) to a function to time beside the library,
    e.g. {("all_reduce", "ring"): ring_all_reduce}.
    """
    for op in ops:
        if op not in LIBRARY:
            raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    cases = [(op, "library", LIBRARY[op]) for op in ops]
    cases += [(op, impl, fn) for (op, impl), fn in (custom or {}).items()]
    return run_on_ranks(_rank_sweep, world_size, args=(cases, list(sizes), repeats, warmup), backend=backend,
                  timeout=timeout)[0]
