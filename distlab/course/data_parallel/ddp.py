"""What chapter 2's lab hands the learner: the `Bucket` container, and PyTorch's DDP in the labs' loop.

    bucket = Bucket([p3, p2], dtype=torch.float32)   # flat buffer on the parameters' device
    bucket.views[0] is shaped like p3 and lives inside bucket.flat

    wrapped = TorchDDP(model)       # DistributedDataParallel with the labs' interface
    lm_loss(wrapped, x, y).backward(); wrapped.finish_gradient_synchronization(); opt.step()

Placement: the flat buffer is made on the parameters' device (a rank's GPU
under NCCL), so an all-reduce of it and copies into it never cross devices.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel


class Bucket:
    """A group of parameters whose gradients travel in one all-reduce.

    params: the parameters, in the order backward finishes them (reverse of
      `module.parameters()`).
    flat: one contiguous buffer holding all their gradients (numel = sum of
      sizes), on the parameters' device, in `dtype` (default: theirs).
    views[i]: params[i]'s slice of `flat`, shaped like params[i]: after
      synchronisation it becomes params[i].grad.
    ready: how many of `params` have their gradient in `flat` this step.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype | None = None) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("a Bucket needs at least one parameter")
        first = self.params[0]
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=dtype or first.dtype,
                                device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer: what one all-reduce of this bucket carries (S)."""
        return self.flat.numel() * self.flat.element_size()

    def __repr__(self) -> str:
        return f"Bucket({len(self.params)} params, {self.flat.numel():,} x {self.flat.dtype}, ready {self.ready})"


class TorchDDP(DistributedDataParallel):
    """PyTorch's DDP with the labs' interface: it synchronises inside `backward()`, so
    `finish_gradient_synchronization()` has nothing left to do."""

    def finish_gradient_synchronization(self) -> None:
        pass
