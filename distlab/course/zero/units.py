"""ZeRO-3's units: the groups of parameters gathered and freed together, and how a module sees them.

Lab 5 builds ZeRO-3 on these pieces. A *unit* is a list of modules run one
after another (one transformer block, or the embeddings); its parameters are
flattened into one buffer, padded to a multiple of N, and each rank keeps
only its 1/N slice, the unit's *shard*. Between uses a module's parameter
slots hold None; while the unit computes they hold views of a gathered
buffer, produced by `GatherViews` so that autograd hands the unit's
gradients back in one call.

    units = block_units(model)          # [[tok, pos], [block0], ..., [ln_f, head]]
    unit = Unit(0, units[0])
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn


def block_units(model: nn.Module) -> list[list[nn.Module]]:
    """Units of the course GPT in forward order: embeddings, one per block, final LayerNorm + head."""
    return [[model.tok, model.pos], *[[b] for b in model.blocks], [model.ln_f, model.head]]


def whole_model_unit(model: nn.Module) -> list[list[nn.Module]]:
    """One unit holding every parameter: ZeRO-3 that gathers the whole model at once."""
    return [[model]]


def direct_params(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(owning module, attribute name, parameter) for every parameter slot under `module`."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                yield sub, name, p


class Unit:
    """The parameters one ZeRO-3 rank gathers and frees together.

    index: position in forward order; modules: the modules, in call order.
    names: (module, attribute name, shape, numel) of each parameter, in flat order.
    numel: parameters in the unit; padded: numel rounded up to a multiple of N.
    shard: this rank's fp32 slice of the flat parameters (padded / N elements),
      an `nn.Parameter` the optimizer owns; its `.grad` is this rank's slice of
      the mean gradient.
    full: the gathered flat parameters (in the compute dtype) while the unit is
      in use, else None.
    pending: (async Work, buffer) of an all-gather launched ahead (prefetch, or
      `_start_gather` before `_wait_gather`), else None.
    """

    def __init__(self, index: int, modules: list[nn.Module]) -> None:
        self.index, self.modules = index, modules
        self.names: list[tuple[nn.Module, str, torch.Size, int]] = []
        self.numel = 0
        self.padded = 0
        self.shard: nn.Parameter | None = None
        self.full: torch.Tensor | None = None
        self.pending: tuple[Any, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"Unit({self.index}, {len(self.names)} params, numel={self.numel}, padded={self.padded})"


class GatherViews(torch.autograd.Function):
    """Forward: a unit's gathered flat buffer -> one view per parameter (no copy).

    Backward: autograd calls it once, when the gradients of *all* the unit's
    views are final, and it hands them to `owner._reduce_scatter(unit, grads)`.
    It returns no gradient for `shard` (the input that ties the views to the
    unit in the graph): the owner writes `shard.grad` itself, once its async
    reduce-scatter has completed.
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, owner: Any, unit: Unit, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.unit = owner, unit
        views, offset = [], 0
        for _, _, shape, n in unit.names:
            views.append(full[offset:offset + n].view(shape))
            offset += n
        return tuple(views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.owner._reduce_scatter(ctx.unit, grads)
        return None, None, None, None


def qualified_names(module: nn.Module, units: list[Unit]) -> list[list[str]]:
    """The qualified parameter names ('blocks.0.fc.weight') of each unit, in flat order."""
    qual = {id(m): name for name, m in module.named_modules()}
    out = []
    for unit in units:
        names = []
        for mod, attr, _, _ in unit.names:
            prefix = qual.get(id(mod), "?")
            names.append(f"{prefix}.{attr}" if prefix else attr)
        out.append(names)
    return out


def full_params(module: nn.Module, units: list[Unit]) -> dict[str, torch.Tensor]:
    """{qualified name: full fp32 parameter}, gathered from every rank's unit shards.

    A collective (one all-gather per unit, on the shards' device): call it on every rank.
    """
    from distlab.engine.collectives import all_gather_tensor
    n = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for unit, names in zip(units, qualified_names(module, units)):
        shard = unit.shard.detach().float()
        full = torch.empty(shard.numel() * n, dtype=torch.float32, device=shard.device)
        if n > 1:
            all_gather_tensor(full, shard)
        else:
            full.copy_(shard)
        offset = 0
        for (_, _, shape, k), name in zip(unit.names, names):
            out[name] = full[offset:offset + k].view(shape).clone()
            offset += k
    return out
