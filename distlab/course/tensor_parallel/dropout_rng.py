"""Dropout's random numbers under tensor and sequence parallelism: which ranks must draw the same masks.

Under TP the residual stream is *replicated*: every rank holds the same B x S x h tensor, so a dropout there
must draw the same mask on every rank (one seed), or the replicas stop being replicas. Inside the TP region
each rank holds *different* things (its a/t heads, its 4h/t features), and under SP its own S/t tokens: a
dropout there must draw independent masks (a seed per rank), or every rank drops the same positions of its
heads or tokens — correlated dropout, not the model's. Megatron-LM keeps two generator states and switches
to the per-rank one inside the TP region (its "model-parallel RNG tracker"); the lecture writes that in
miniature (`TPRegionRNG`) and passes it in as `tracker`, for the attention modules of chapter 7's model.

    out = distlab.launch(dropout_rng_runs, 2, args=(parallelize, my_tokens, TPRegionRNG, "tp-small", 2))

`parallelize(model, tp_mesh, sp=False)`, `my_tokens(x, tp_mesh)` and `TPRegionRNG(modules, seed, rank, device)`
are the lecture's (its TP / SP plan, its slice of the sequence, its RNG tracker); each rank returns its raw
masks, every mode in one launch.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.course.tensor_parallel.model import TP_PRESETS, build_stack
from distlab.engine import runtime as rt

MODES = ("seed per rank", "one seed", "one seed + TP-region RNG", "SP, one seed", "SP, seed per rank")


class _Masks(TorchDispatchMode):
    """Records the mask of every `native_dropout` (what chapter 7's dropout calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.native_dropout.default:
            self.masks.append(out[1].detach().cpu().clone())
        return out


def dropout_rng_run(parallelize: Callable[..., Any], my_tokens: Callable[..., torch.Tensor], tracker: Callable[..., Any],
                    preset: str, batch: int, mode: str, p: float = 0.1) -> dict[str, Any]:
    """One block of `preset` with dropout `p`, cut by the lecture's `parallelize` (its SP plan and `my_tokens`
    slice of the sequence for the "SP" modes), one
    training-mode forward on the same input on every rank, seeded as `mode` says (`MODES`).

    Returns the block's output on this rank (`out`: the replicated B x S x h under TP, this rank's S/t slice
    under SP) and the dropout masks it drew: `attn` (the attention probabilities' masks, B x a/t x S x S: this
    rank's heads) and `resid` (the residual dropouts' masks: B x S x h under TP, B x S/t x h under SP).
    Nothing crosses the wire but TP's (or SP's) own collectives.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    r, dev, mesh = rt.rank(), rt.device(), rt.mesh()
    sp = mode.startswith("SP")
    cfg = TP_PRESETS[preset]
    stack = parallelize(build_stack(preset, seed=1, n_layers=1, dropout=p), mesh, sp=sp).train()
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(2)).to(dev)
    if sp:
        x = my_tokens(x, mesh).contiguous()
    torch.manual_seed(r if "per rank" in mode else 0)
    if mode == "one seed + TP-region RNG":
        tracker([b.attn for b in stack.blocks], 0, r, dev)      # the per-rank stream inside the TP region
    with _Masks() as rec:
        y = stack(x)
    return dict(out=y.detach().cpu(), attn=[m for m in rec.masks if m.dim() == 4],
                resid=[m for m in rec.masks if m.dim() == 3])


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of positions where two dropout masks agree: 1 for the same mask; 1 - 2p(1-p) expected for
    independent masks of drop probability p."""
    return (a == b).float().mean().item()


def dropout_rng_runs(parallelize: Callable[..., Any], my_tokens: Callable[..., torch.Tensor], tracker: Callable[..., Any],
                     preset: str, batch: int, modes: tuple[str, ...] = MODES, p: float = 0.1) -> dict[str, Any]:
    """`dropout_rng_run` for each of `modes`, in one launch: {mode: its result}."""
    return {mode: dropout_rng_run(parallelize, my_tokens, tracker, preset, batch, mode, p) for mode in modes}

