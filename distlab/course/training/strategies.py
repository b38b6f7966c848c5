"""One argument moves the training loop between strategies: `wrap(name, model, ...)`.

    module, opt, sync_grads = wrap("fsdp2", model, lr=3e-3)            # on every rank
    module, opt, sync_grads = wrap("zero3", model, lr=3e-3, classes={"ZeRO3": ZeRO3})   # the lab's class

`single` is one process; `ddp` PyTorch's DistributedDataParallel; `fsdp2` `fully_shard` per block and root
(chapter 6); `zero1`, `zero2`, `zero3` the labs' `ShardedOptimizer`, `ZeRO2`, `ZeRO3` (chapters 3-5), passed
in `classes` (from a learner's notebook or the solutions: `distlab.apps.simulate.lab_class`); `tp` PyTorch's
tensor parallelism (`parallelize_module`, chapter 7) over every rank; `dp_tp` a 2-D DeviceMesh (dp x tp):
`parallelize_module` over "tp", then `fully_shard` over "dp"; `pp` one pipeline stage per rank with
`torch.distributed.pipelining` (chapter 8's split, `Schedule1F1B` over `microbatches`: see `pp`).
Under `tp` and `pp` every rank reads the whole batch;
under `dp_tp` the ranks of one tp group read the same rows (`data_ranks`). All train fp32
weights with AdamW (lr, betas, weight decay the same everywhere), so every data-parallel strategy computes
the same update as one process up to the order of floating-point additions.

`sync_grads(on)` turns the gradient reduction of the next backward on or off (gradient accumulation: only
the last micro-batch's backward communicates); None when the strategy cannot skip it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

STRATEGIES = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3", "tp", "dp_tp", "pp")
NEEDS_CLASS = {"zero1": ("03_zero1", "ShardedOptimizer"), "zero2": ("04_zero2", "ZeRO2"),
               "zero3": ("05_zero3", "ZeRO3")}
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1


def tp_size(name: str, world_size: int, tp: int = 2) -> int:
    """How many ranks split each layer: every rank under `tp`, `tp` under `dp_tp`, none otherwise."""
    return world_size if name == "tp" else tp if name == "dp_tp" else 1


def data_ranks(name: str, world_size: int, rank: int, tp: int = 2) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size): the loader's `rank` and `world_size`.
    The 2-D mesh is row-major, rank = dp_rank * tp + tp_rank, so the ranks of one tp group are neighbours."""
    if name == "pp":
        return 0, 1                     # one pipeline: every stage is fed the same global batch
    t = tp_size(name, world_size, tp)
    return rank // t, world_size // t


def check_strategy(name: str, world_size: int, classes: dict[str, Any] | None = None, *, tp: int = 2,
                   n_heads: int | None = None, n_layers: int | None = None, microbatches: int | None = None) -> None:
    """Raise ValueError, in a learner's words, unless `name` can run on `world_size` ranks."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if name == "single" and world_size != 1:
        raise ValueError(f"strategy 'single' is one process: use world size 1, not {world_size}")
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if name == "dp_tp" and (tp < 1 or world_size % tp):
        raise ValueError(f"strategy 'dp_tp' lays {world_size} ranks out as dp x tp with tp = {tp}: use a world size "
                         f"that is a multiple of {tp} (or another tp)")
    if name == "pp" and n_layers is not None and world_size > n_layers:
        raise ValueError(f"strategy 'pp' cuts the model's {n_layers} blocks into one stage per rank: {world_size} "
                         f"ranks would leave {world_size - n_layers} stage(s) without a block. Use at most "
                         f"{n_layers} ranks, or a model with at least {world_size} layers (n_layers)")
    if name == "pp" and microbatches is not None and microbatches < world_size:
        # Schedule1F1B's warm-up hands each stage one micro-batch before any comes back: it needs m >= p
        raise ValueError(f"strategy 'pp' on {world_size} stages needs at least {world_size} micro-batches per step "
                         f"(1F1B fills the pipeline with one per stage), got {microbatches}: use accumulate "
                         f"(--accumulate) of {world_size} or more, dividing each step's rows")
    t = tp_size(name, world_size, tp)
    if n_heads is not None and n_heads % t:
        raise ValueError(f"strategy {name!r} splits each layer's {n_heads} attention heads over {t} ranks: use a "
                         f"tensor-parallel size that divides {n_heads}")
    if name in NEEDS_CLASS and NEEDS_CLASS[name][1] not in (classes or {}):
        lab, cls = NEEDS_CLASS[name]
        raise ValueError(f"strategy {name!r} runs lab {lab}'s {cls} class: pass classes={{'{cls}': {cls}}} "
                         "(distlab.apps.simulate.lab_class loads it from a notebook)")


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def wrap(name: str, model: nn.Module, *, lr: float, classes: dict[str, Any] | None = None, tp: int = 2,
         microbatches: int = 1) -> tuple[nn.Module, Any, Callable[[bool], Any] | None]:
    """(what forward runs, what `step()` / `zero_grad()` are called on, the gradient-sync switch).
    Under `pp` the first is a `Pipeline` (its step is `pp.pipeline_step`), over `microbatches`."""
    import torch.distributed as dist
    n = dist.get_world_size() if dist.is_initialized() else 1
    check_strategy(name, n, classes, tp=tp, n_heads=model.config.n_heads, n_layers=model.config.n_layers,
                   microbatches=microbatches)
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
    if name == "tp":
        from distlab.engine.runtime import mesh
        tensor_parallel_blocks(model, mesh())
        return model, adamw(model.parameters(), lr), lambda on: None   # nothing to skip: no gradient reduction
    if name == "pp":
        from distlab.course.training.pp import pipeline_parallel
        pipe = pipeline_parallel(model, microbatches)       # no gradient reduction: each rank owns its stage
        return pipe, adamw(pipe.parameters(), lr), lambda on: None   # type: ignore[return-value]
    if name == "dp_tp":
        from torch.distributed.fsdp import fully_shard
        from distlab.engine.runtime import mesh
        m = mesh(n // tp, tp, names=("dp", "tp"))
        tensor_parallel_blocks(model, m["tp"])          # first split each layer over the tp group ...
        for block in model.blocks:
            fully_shard(block, mesh=m["dp"])            # ... then shard those pieces over the dp group
        fully_shard(model, mesh=m["dp"])
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


def tensor_parallel_blocks(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Megatron's cut of every block with `parallelize_module` (chapter 7), for the course GPT's fused QKV.

    The MLP is the textbook pair: `fc` column-wise (each rank a slice of the 4d hidden units), `out` row-wise
    (partial sums, one all-reduce of the (B, T, d) output). Attention's Q, K and V live in one (3d, d) matrix,
    and a contiguous column-wise shard of it would give rank 0 all of Q and half of K: not whole heads. So
    `qkv` is column-wise (each rank stores and multiplies 3d/tp rows), its (B, T, 3d/tp) outputs are
    all-gathered (`_GatherColumns`), each rank attends with its own n_heads/tp heads, and `proj` is row-wise
    over those heads. In backward each rank's gradient of the gathered output is non-zero only in its heads'
    columns, and a reduce-scatter sums the ranks' gradients into each rank's 3d/tp columns. The embeddings,
    LayerNorms and head stay whole on every rank; their gradients agree because every input gradient that
    reaches them has been all-reduced. Parameter names and global shapes do not change: a checkpoint saved by
    one strategy loads under another.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
        forward = functools.partial(_tp_block_forward, block, tp_mesh.get_group(), tp_mesh.size(),
                                    tp_mesh.get_local_rank())
        if "forward" in vars(block):      # `recompute_blocks` came first: recompute this forward instead
            from torch.utils.checkpoint import checkpoint
            forward = functools.partial(checkpoint, forward, use_reentrant=False)
        block.forward = forward
    return model


class _GatherColumns(torch.autograd.Function):
    """Forward: all-gather the ranks' (B, T, c) column blocks into (B, T, tp·c), in rank order. Backward:
    reduce-scatter the (B, T, tp·c) gradient back to this rank's block, summed over the ranks. Plain c10d
    collectives on contiguous buffers, issued from autograd like Megatron's f and g."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, tp: int) -> torch.Tensor:
        import torch.distributed as dist
        ctx.group, ctx.tp = group, tp
        parts = local.new_empty((tp * local.shape[0], *local.shape[1:]))     # rank s's block is rows s·B ...
        dist.all_gather_into_tensor(parts, local.contiguous(), group=group)
        return parts.unflatten(0, (tp, -1)).movedim(0, -2).flatten(-2)       # (B, T, tp, c) -> (B, T, tp·c)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist
        parts = grad.unflatten(-1, (ctx.tp, -1)).movedim(-2, 0).contiguous()   # (tp, B, T, c)
        mine = parts.new_empty(parts.shape[1:])
        parts = parts.flatten(0, 1)
        dist.reduce_scatter_tensor(mine, parts, group=ctx.group)
        return mine, None, None


def _tp_block_forward(block: nn.Module, group: Any, tp: int, r: int, x: torch.Tensor) -> torch.Tensor:
    """The course Block's forward on this rank's heads (see `tensor_parallel_blocks`)."""
    import torch.nn.functional as F
    from distlab.engine.precision import compute_dtype
    x = x.to(compute_dtype(x.dtype, x.device))
    b, t, d = x.shape
    h, hd = block.n_heads // tp, d // block.n_heads
    qkv = _GatherColumns.apply(block.qkv(block.ln1(x)), group, tp)     # every head's q, k, v: (B, T, 3d)
    q, k, v = (z.view(b, t, block.n_heads, hd)[:, :, r * h:(r + 1) * h].transpose(1, 2) for z in qkv.split(d, dim=2))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(a.transpose(1, 2).reshape(b, t, h * hd))       # row-wise: all-reduce of (B, T, d)
    return x + block.out(F.gelu(block.fc(block.ln2(x))))               # column- then row-wise: one all-reduce
