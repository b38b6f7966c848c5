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

from typing import Any, Callable, Iterator

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


def _replicate_rule(module: nn.Module, replicate: Any) -> Callable[[str, nn.Parameter], bool]:
    """`replicate` (None, names, or a predicate (qualified name, parameter) -> bool) as a predicate."""
    if replicate is None:
        return lambda name, p: False
    if callable(replicate):
        return replicate
    if isinstance(replicate, str):
        replicate = [replicate]
    names = [name for name, _ in module.named_parameters()]
    unknown = [m for m in replicate if not any(n == m or n.startswith(m + ".") for n in names)]
    if unknown:
        raise ValueError(f"replicate names {unknown}, which match no parameter of {type(module).__name__}: name a "
                         f"module or a parameter by its qualified name, e.g. {names[0]!r} or "
                         f"{names[0].rsplit('.', 1)[0]!r}")
    return lambda name, p: any(name == m or name.startswith(m + ".") for m in replicate)


def _world() -> tuple[int, int]:
    """(world size, rank); (1, 0) without a process group."""
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


class ShardedModule(nn.Module):
    """What makes a ZeRO-3 wrapper an ordinary module to torch: its shards are its parameters.

    Lab 5's `ZeRO3` derives from it. Its given code calls `_set_replicated(...)` before the units
    are built and `_register_shards()` after; then

        zero = ZeRO3(model, replicate=lambda name, p: p.ndim == 1)    # LayerNorms whole on every rank
        opt = torch.optim.AdamW(zero.parameters(), lr=1e-3)           # any optimizer, as on one process
        lm_loss(zero, x, y).backward(); opt.step(); opt.zero_grad()
        torch.save({"model": zero.state_dict(), "opt": opt.state_dict()}, f"ckpt/rank{rank}.pt")

    parameters() / named_parameters(): this rank's flat shard of each unit, `flat_shards.unit{i}`
      (unit i's padded/N fp32 elements, an `nn.Parameter` whose .grad after backward is this rank's
      slice of the mean gradient), then the parameters kept whole on every rank, under their own names
      (`module.ln_f.weight`; .grad after backward: the mean over ranks, all-reduced). The wrapped
      module's other slots hold None between steps. What is computed over `parameters()` is this rank's
      part only: `clip_grad_norm_(zero.parameters(), c)` clips by a local norm (FSDP2's DTensors reduce
      theirs); clip by the global one, sqrt(all_reduce(local squared norm of the shards)) (+ the
      replicated gradients' squared norm, counted once).
    replicate: None (shard everything), qualified names of modules or parameters ('pos', 'ln_f',
      'blocks.0.ln1.weight'), or a predicate (name, parameter) -> bool. A replicated parameter starts
      from rank 0's value (one broadcast each) and its gradient is all-reduced (one all-reduce each,
      Ψ_rep·4·2(N-1)/N bytes per step); a unit left with nothing to shard is dropped. A replicated
      parameter is used as it is, fp32, never cast: where the gathered units compute in bf16 (a GPU
      with gather_dtype=bf16), replicate only what takes fp32 weights with bf16 inputs.
    state_dict(): what this rank saves: its own flat shards (not the model: 1/N of each unit), the
      replicated parameters, the module's buffers, and `_extra_state`: world size, rank, and each unit's
      parameter names, numel and padded size. Save it per rank (`torch.save` to a file of its own, with
      the optimizer's `state_dict()`). `load_state_dict` checks the layout first and refuses, before
      copying anything, another rank's file or one saved on another world size (resharding flat shards
      is lab 9's `load_shard`); `gather_full_params()` gives the whole model, for a portable checkpoint.
      Not `torch.distributed.checkpoint` as it stands: it keeps one copy of a plain tensor that every
      rank names alike (it takes it for replicated), where FSDP2's DTensors carry their placement.
    """

    def _set_replicated(self, module: nn.Module, units: list[list[nn.Module]], replicate: Any
                        ) -> list[list[nn.Module]]:
        """Take the replicated parameters out of their slots (the unit loop never sees them), broadcast
        them from rank 0, and return the units that still have a parameter to shard."""
        keep = _replicate_rule(module, replicate)
        self._replicated = []      # (qualified name, owner module, attribute, parameter)
        for prefix, sub in module.named_modules():
            for attr, p in list(sub._parameters.items()):
                name = f"{prefix}.{attr}" if prefix else attr
                if p is not None and keep(name, p):
                    self._replicated.append((name, sub, attr, p))
                    if _world()[0] > 1:
                        with torch.no_grad():
                            dist.broadcast(p.data, src=0)     # every rank starts from rank 0's values
                    sub._parameters[attr] = None
        return [mods for mods in units if any(True for m in mods for _ in direct_params(m))]

    def _register_shards(self) -> None:
        """The units' shards become this module's parameters (`flat_shards.unit{i}`); the replicated parameters
        go back to their slots, each with a hook that all-reduces its gradient once it is accumulated."""
        self.flat_shards = nn.ParameterDict({f"unit{u.index}": u.shard for u in self.units})
        self._replica_works: list[Any] = []
        for _, owner, attr, p in getattr(self, "_replicated", []):
            owner._parameters[attr] = p
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reduce_replica)

    def _reduce_replica(self, p: nn.Parameter) -> None:
        # The gradient of a parameter every rank holds whole: the mean over ranks, like DDP. With
        # accumulation, p.grad = (already reduced, equal everywhere) + this backward's: the mean still holds.
        n = _world()[0]
        if n == 1:
            return
        p.grad.div_(n)
        if not self._replica_works:
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_replicas)
        self._replica_works.append(dist.all_reduce(p.grad, async_op=True))

    def _wait_replicas(self) -> None:
        works, self._replica_works = self._replica_works, []
        for work in works:
            work.wait()

    def shards(self) -> list[nn.Parameter]:
        """This rank's flat shard of each unit, in unit order."""
        return [u.shard for u in self.units]

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 parameter} from every rank's shards, the replicated ones included (one
        all-gather per unit; call it on every rank)."""
        out = full_params(self.module, self.units)
        for name, _, _, p in getattr(self, "_replicated", []):
            out[name] = p.detach().float().clone()
        return out

    def _layout(self) -> dict[str, Any]:
        n, r = _world()
        return {"world_size": n, "rank": r,
                "units": [{"names": names, "numel": u.numel, "padded": u.padded}
                          for u, names in zip(self.units, qualified_names(self.module, self.units))],
                "replicated": [name for name, *_ in getattr(self, "_replicated", [])]}

    def get_extra_state(self) -> dict[str, Any]:
        return self._layout()

    def set_extra_state(self, state: Any) -> None:
        pass       # checked in _load_from_state_dict, before any tensor is copied

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        saved, here = state_dict.get(prefix + "_extra_state"), self._layout()
        if saved is not None and saved != here:
            n, r, what = here["world_size"], here["rank"], type(self).__name__
            theirs = f"rank {saved['rank']} of {saved['world_size']}"
            if saved["world_size"] != n:
                raise ValueError(f"rank {r}: this checkpoint holds the flat shards of {theirs}, but this {what} "
                                 f"runs on {n} ranks. Each rank saved only its own 1/N of every unit: load it on "
                                 f"{saved['world_size']} ranks, or reshard the flat shards by hand (lab 9's "
                                 "load_shard), or save gather_full_params() instead")
            if saved["rank"] != r:
                raise ValueError(f"rank {r}: this checkpoint holds the shards of {theirs}; load the file rank {r} "
                                 "saved (each rank saves its own state_dict with torch.save: "
                                 "torch.distributed.checkpoint would keep one rank's shards only)")
            diff = next((i for i, (a, b) in enumerate(zip(saved["units"], here["units"])) if a != b),
                        min(len(saved["units"]), len(here["units"])))
            raise ValueError(f"rank {r}: the checkpoint's units differ from this {what}'s (first at unit {diff}; "
                             f"replicated: {saved['replicated']} saved, {here['replicated']} here): build it with "
                             "the same model, units and replicate as when it was saved")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the shards the units compute with; "
                             "load with assign=False (the values are copied into them)")
        return super().load_state_dict(state_dict, strict=strict)
