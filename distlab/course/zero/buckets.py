"""ZeRO-2's gradient buckets: runs of parameters whose gradients are reduce-scattered together.

Lab 4 builds ZeRO-2 on this bookkeeping. Backward finishes parameters roughly
in the reverse of `model.parameters()`; a bucket collects consecutive ones in
that order until it holds about `bucket_size_mb`, and is reduce-scattered as
soon as its last gradient is in. Buckets lie one after another in one flat
parameter buffer; each is padded to a multiple of N so that it splits into N
equal chunks, and rank r owns chunk r of every bucket.

    bucket = GradBucket([p_head, p_ln], start=0, world_size=2)
    bucket.numel, bucket.chunk          # padded size, and numel / N
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class GradBucket:
    """A run of consecutive trainable parameters whose gradients are reduce-scattered together.

    params: the parameters, in the order backward finishes them (reverse of
      `parameters()`); offsets[i]: where params[i] starts inside the bucket.
    used: elements the parameters fill; numel: `used` padded up to a multiple
      of N; chunk = numel / N, the part of the bucket each rank owns.
    start: where the bucket begins in the flat parameter buffer (set by whoever
      lays the buckets out: buckets follow one another).
    flat: the full-size gradient buffer of this bucket, alive only from its
      first gradient of a step until its reduce-scatter has completed (None
      otherwise).
    grad_shard: this rank's chunk of the bucket's summed gradient (chunk
      elements): where the reduce-scatter delivers, kept across steps.
    ready: how many of `params` have copied their gradient into `flat` this step.
    """

    def __init__(self, params: Sequence[torch.Tensor], start: int, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.params = list(params)
        self.offsets: list[int] = []
        used = 0
        for p in self.params:
            self.offsets.append(used)
            used += p.numel()
        self.used = used
        self.numel = -(-used // world_size) * world_size  # ceil to a multiple of N
        self.chunk = self.numel // world_size
        self.start = start
        self.flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.ready = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters in this bucket (no padding)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def __repr__(self) -> str:
        return (f"GradBucket({len(self.params)} params, start={self.start}, used={self.used}, "
                f"numel={self.numel}, chunk={self.chunk})")


def describe(buckets: Sequence[GradBucket], names: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """Plain data about a list of buckets (for checks and printouts): names or numels of the
    parameters, offsets, start, used, numel, chunk. `names` maps id(param) -> name."""
    out = []
    for b in buckets:
        out.append({
            "params": [names.get(id(p), "?") if names is not None else p.numel() for p in b.params],
            "numels": [p.numel() for p in b.params],
            "element_sizes": [p.element_size() for p in b.params],
            "offsets": list(b.offsets), "start": b.start, "used": b.used, "numel": b.numel, "chunk": b.chunk,
        })
    return out
