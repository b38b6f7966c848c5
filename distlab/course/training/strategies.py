"""One argument moves the training loop between strategies: `wrap(name, model, ...)`.

    module, opt, sync_grads = wrap("fsdp2", model, lr=3e-3)            # on every rank
    module, opt, sync_grads = wrap("zero3", model, lr=3e-3, classes={"ZeRO3": ZeRO3})   # the lab's class

`single` is one process; `ddp` PyTorch's DistributedDataParallel; `fsdp2` `fully_shard` per block and root
(chapter 6); `zero1`, `zero2`, `zero3` the labs' `ShardedOptimizer`, `ZeRO2`, `ZeRO3` (chapters 3-5), passed
in `classes` (from a learner's notebook or the solutions: `distlab.apps.simulate.lab_class`). All train fp32
weights with AdamW (lr, betas, weight decay the same everywhere), so every data-parallel strategy computes
the same update as one process up to the order of floating-point additions.

`sync_grads(on)` turns the gradient reduction of the next backward on or off (gradient accumulation: only
the last micro-batch's backward communicates); None when the strategy cannot skip it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

STRATEGIES = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")
NEEDS_CLASS = {"zero1": ("03_zero1", "ShardedOptimizer"), "zero2": ("04_zero2", "ZeRO2"),
               "zero3": ("05_zero3", "ZeRO3")}
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1


def check_strategy(name: str, world_size: int, classes: dict[str, Any] | None = None) -> None:
    """Raise ValueError, in a learner's words, unless `name` can run on `world_size` ranks."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if name == "single" and world_size != 1:
        raise ValueError(f"strategy 'single' is one process: use world size 1, not {world_size}")
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if name in NEEDS_CLASS and NEEDS_CLASS[name][1] not in (classes or {}):
        lab, cls = NEEDS_CLASS[name]
        raise ValueError(f"strategy {name!r} runs lab {lab}'s {cls} class: pass classes={{'{cls}': {cls}}} "
                         "(distlab.apps.simulate.lab_class loads it from a notebook)")


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def wrap(name: str, model: nn.Module, *, lr: float, classes: dict[str, Any] | None = None
         ) -> tuple[nn.Module, Any, Callable[[bool], Any] | None]:
    """(what forward runs, what `step()` / `zero_grad()` are called on, the gradient-sync switch)."""
    import torch.distributed as dist
    n = dist.get_world_size() if dist.is_initialized() else 1
    check_strategy(name, n, classes)
    if name == "single":
        return model, adamw(model.parameters(), lr), lambda on: None
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[model.tok.weight.device] if model.tok.weight.is_cuda else None)
        state = {"ctx": None}

        def sync(on: bool) -> None:   # DDP skips its all-reduce inside no_sync()
            if state["ctx"] is not None:
                state["ctx"].__exit__(None, None, None)
                state["ctx"] = None
            if not on:
                state["ctx"] = ddp.no_sync()
                state["ctx"].__enter__()
        return ddp, adamw(model.parameters(), lr), sync
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        from distlab.engine.runtime import mesh
        m = mesh()
        for block in model.blocks:
            fully_shard(block, mesh=m)
        fully_shard(model, mesh=m)
        return model, adamw(model.parameters(), lr), lambda on: model.set_requires_gradient_sync(on)
    cls = classes[NEEDS_CLASS[name][1]]   # type: ignore[index]
    if name == "zero1":
        return model, cls(model.parameters(), torch.optim.AdamW, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY), None
    if name == "zero2":
        return model, cls(model.parameters(), torch.optim.AdamW, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY), None
    z = cls(model, optimizer=lambda shards: adamw(shards, lr))
    return z, z.optimizer, None


def recompute_blocks(model: nn.Module) -> None:
    """Activation recomputation: each block keeps only its input for backward and runs its forward again
    there (`torch.utils.checkpoint`, non-reentrant). The parameter names do not change: checkpoints stay
    compatible with and without it."""
    from torch.utils.checkpoint import checkpoint
    for block in model.blocks:
        plain = block.forward
        block.forward = lambda x, f=plain: checkpoint(f, x, use_reentrant=False)
