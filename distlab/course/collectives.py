"""Chapter 1's ring pieces: how a flat tensor splits into one chunk per rank, and how chunks combine.

The lab's ring reduce-scatter, all-gather and all-reduce are built from send/recv
and these two helpers; chapter 1's checks and chapter 8's stages use them too.
(The version-safe all-gather and reduce-scatter every later chapter calls are
`distlab.engine.collectives`.)
"""
from __future__ import annotations

import torch.distributed as dist

# ---- the pieces a hand-written ring needs (chapter 1's lab uses them, and so do its checks) ----

def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, end) of each of the n chunks of a flat tensor; chunk r belongs to rank r.

    When n does not divide numel, the first numel % n chunks get one extra
    element (with numel < n, the last chunks are empty).
    """
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def combine(op, acc, incoming) -> None:
    """acc <- acc (op) incoming, in place; op is dist.ReduceOp.SUM or dist.ReduceOp.MAX."""
    import torch
    if op == dist.ReduceOp.SUM:
        acc.add_(incoming)
    elif op == dist.ReduceOp.MAX:
        torch.maximum(acc, incoming, out=acc)
    else:
        raise ValueError(f"combine supports SUM and MAX, got {op}")
