"""Chapter 7's model and measurement helpers: a transformer laid out the way tensor parallelism cuts it.

The course GPT (`distlab.course.models`) fuses Q, K and V into one `qkv` Linear and
lets SDPA pick a kernel. Tensor parallelism needs the opposite: separate
projections that can each be split by heads, and an attention core whose
saved tensors are known, so activation memory can be measured against the
closed form of `distlab.theory.tensor_parallel`. This module holds that model (no
parallelism in it), the PyTorch plans that parallelise it, and a meter that
books traffic per process group.

    model = build_tp_model("tp-small")               # on distlab.device()
    logits = model(tokens)                           # (B, S, vocab)

Shapes: B batch, S sequence, h = d_model, a = n_heads, hd = h / a.
Every layer of the block counts heads from its weights (`view(b, s, -1, hd)`),
so a copy whose projections hold a/t heads (tensor parallel degree t) runs
the same code.

What autograd keeps per block (B S h elements of e bytes each, p > 0 dropout
masks 1 byte): LN inputs 2, LN outputs 2, Q K V 3, attention output 1, MLP
4 + 4, masks 2 / e, and a x S x S scores kept twice (softmax output, dropout
output) plus their mask: the 34 + 5 a S / h of Korthikanti et al. at e = 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class TPConfig:
    vocab_size: int = 128
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 8
    n_layers: int = 2
    dropout: float = 0.0       # p of the three dropouts per block (0: none, no masks kept)
    recompute: str = "none"    # "selective": recompute the attention core in backward; "full": each block

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Every size is divisible by 1, 2, 4 and 8: any tensor- or sequence-parallel degree up to 8 works.
TP_PRESETS: dict[str, TPConfig] = {
    "tp-tiny": TPConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=8, n_layers=1),
    "tp-small": TPConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=8, n_layers=2),
    "tp-medium": TPConfig(vocab_size=256, seq_len=64, d_model=256, n_heads=8, n_layers=4),
}


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that keeps a 1-byte mask on every device (`F.dropout` keeps an e-byte one on CPUs)."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   p: float = 0.0, training: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal) v for (B, heads, S_q, hd) inputs; written out, no fused kernel.

    Kept for backward: q, k, v, the softmax output and the dropout output (a x S x S each) and
    the dropout mask. `mask`: True where a query may not look (S_q, S_k), or None.
    """
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))     # (B, a, S_q, S_k)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    att = dropout(scores.softmax(-1), p, training)
    return att @ v                                                        # (B, a, S_q, hd)


class Attention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V, O projections (Megatron's cut points)."""

    def __init__(self, c: TPConfig) -> None:
        super().__init__()
        h = c.d_model
        self.head_dim, self.p, self.selective = c.head_dim, c.dropout, c.recompute == "selective"
        self.wq, self.wk, self.wv = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.wo = nn.Linear(h, h)
        # A constant made once: slices of it are views, so the causal mask costs no activation memory.
        self.register_buffer("causal", torch.ones(c.seq_len, c.seq_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (B, S, heads x hd) -> (B, heads, S, hd); heads = what this copy's weights hold
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.selective and torch.is_grad_enabled():   # keep q, k, v; recompute the S x S part
            y = checkpoint(attention_core, q, k, v, self.causal[:s, :s], self.p, self.training, use_reentrant=False)
        else:
            y = attention_core(q, k, v, self.causal[:s, :s], self.p, self.training)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: TPConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.d_model, c.d_ff)
        self.out = nn.Linear(c.d_ff, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)))."""

    def __init__(self, c: TPConfig) -> None:
        super().__init__()
        self.p = c.dropout
        self.ln1, self.attn = nn.LayerNorm(c.d_model), Attention(c)
        self.ln2, self.mlp = nn.LayerNorm(c.d_model), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + dropout(self.attn(self.ln1(x)), self.p, self.training)
        return x + dropout(self.mlp(self.ln2(x)), self.p, self.training)


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, recompute: str) -> torch.Tensor:
    """Each block in turn; under full recomputation only each block's input is kept for backward."""
    for block in blocks:
        if recompute == "full" and torch.is_grad_enabled():
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x


class Transformer(nn.Module):
    """Token + position embeddings, `n_layers` blocks, final LayerNorm, LM head."""

    def __init__(self, c: TPConfig) -> None:
        super().__init__()
        self.config, self.recompute = c, c.recompute
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = run_blocks(self.blocks, x, self.recompute)
        return self.head(self.ln_f(x))   # (B, S, vocab)


class Stack(nn.Module):
    """Just the blocks: input and output (B, S, h). Activation memory is measured on this."""

    def __init__(self, c: TPConfig) -> None:
        super().__init__()
        self.config, self.recompute = c, c.recompute
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, x, self.recompute)


def set_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Switch a built model between no, selective and full recomputation (in place)."""
    from distlab.theory.tensor_parallel import RECOMPUTE
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {mode!r}")
    model.recompute = mode
    for m in model.modules():
        if isinstance(m, Attention):
            m.selective = mode == "selective"
    return model


def _config(preset: str | TPConfig, overrides: dict) -> TPConfig:
    if isinstance(preset, str):
        if preset not in TP_PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(TP_PRESETS)}")
        preset = TP_PRESETS[preset]
    return replace(preset, **overrides)


def _build(cls: type, preset: str | TPConfig, seed: int, device: Any, dtype: torch.dtype | None,
           overrides: dict) -> nn.Module:
    from distlab.course.models import _device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(_config(preset, overrides))
    return model.to(device=_device(device), dtype=dtype)


def build_tp_model(preset: str | TPConfig = "tp-small", *, seed: int = 0, device: Any = None,
                   dtype: torch.dtype | None = None, **overrides: Any) -> Transformer:
    """The same weights for the same seed everywhere; on `device` (default: the rank's)."""
    return _build(Transformer, preset, seed, device, dtype, overrides)  # type: ignore[return-value]


def build_stack(preset: str | TPConfig = "tp-small", *, seed: int = 0, device: Any = None,
                dtype: torch.dtype | None = None, **overrides: Any) -> Stack:
    """`n_layers` blocks without embeddings or head (activation-memory measurements)."""
    return _build(Stack, preset, seed, device, dtype, overrides)  # type: ignore[return-value]


def block_params(c: TPConfig) -> int:
    """Parameters of one block: 4h^2 + 4h (attention) + 8h^2 + 5h (MLP) + 4h (two LayerNorms)."""
    h = c.d_model
    return 12 * h * h + 13 * h


# ---- PyTorch's own tensor parallelism on this model -------------------------------------------------

def torch_block_plan(sp: bool = False) -> dict[str, Any]:
    """The `parallelize_module` plan of one Block: Megatron's cut with PyTorch's parallel styles.

    Q, K, V and the MLP's first layer column-wise, the attention output and the MLP's second
    layer row-wise. `PrepareModuleInput` makes one replicated DTensor at the entry of attention
    and of the MLP, so Q, K and V's input gradients add up before a single all-reduce (Megatron's
    f); without it each column-parallel linear all-reduces its own. With `sp`, the LayerNorms
    run on sequence shards (`SequenceParallel`), the entries all-gather the sequence and the
    row-parallel outputs reduce-scatter it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    out_layout = Shard(1) if sp else Replicate()
    enter = PrepareModuleInput(input_layouts=(Shard(1) if sp else Replicate(),), desired_input_layouts=(Replicate(),))
    plan: dict[str, Any] = {
        "attn": enter, "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=out_layout),
        "mlp": enter, "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel(output_layouts=out_layout),
    }
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


def parallelize_blocks(model: nn.Module, tp_mesh: Any, sp: bool = False) -> nn.Module:
    """`parallelize_module` on every block of `model` (in place). Under `sp`, each block takes and
    returns its rank's slice of the sequence: the caller slices the input and gathers the output."""
    from torch.distributed.tensor.parallel import parallelize_module
    for block in model.blocks:
        parallelize_module(block, tp_mesh, torch_block_plan(sp))
    return model


# ---- traffic per process group ------------------------------------------------------------------------

def _group_ranks(args: tuple, group_name: str | None = None) -> tuple[int, ...]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    if group_name is None:
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    group_name = dist.ProcessGroup.unbox(a).group_name
                    break
                except Exception:  # noqa: BLE001 - a ReduceOp or Work, not a group
                    continue
    if group_name is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


class _GroupMeter:
    """Wraps the engine's comm meter: the same bytes, also booked per group (its ranks)."""

    def __init__(self) -> None:
        from distlab.meters.comm import _C10D_KINDS, _FUNCTIONAL_KINDS, _CommMeter
        outer = self
        self.by_group: dict[tuple[int, ...], dict[str, int]] = {}
        self.calls_by_group: dict[tuple[int, ...], dict[str, int]] = {}
        self._ranks: tuple[int, ...] = ()

        class Meter(_CommMeter):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                name = func.__name__.split(".")[0]
                if func.namespace == "_c10d_functional" and name in _FUNCTIONAL_KINDS:
                    outer._ranks = _group_ranks((), args[-1])
                elif func.namespace == "c10d" and name in _C10D_KINDS:
                    outer._ranks = _group_ranks(args)
                return super().__torch_dispatch__(func, types, args, kwargs)

            def _add(self, kind: str, sent: int) -> None:
                super()._add(kind, sent)
                g = outer.by_group.setdefault(outer._ranks, {})
                g[kind] = g.get(kind, 0) + sent
                c = outer.calls_by_group.setdefault(outer._ranks, {})
                c[kind] = c.get(kind, 0) + 1

        self.meter = Meter()
        # The same dicts on the meter itself: under `distlab grade` (a Python process group, no dispatcher op to
        # see) the grader's audit hook books each op into them, under its group's ranks.
        self.meter.by_group, self.meter.calls_by_group = self.by_group, self.calls_by_group

    def stats(self) -> dict[tuple[int, ...], dict[str, int]]:
        return {g: dict(v) for g, v in self.by_group.items()}


class track_comm_by_group:  # noqa: N801 - used like the engine's track_comm
    """`with track_comm_by_group() as m:` ... `m.by_group[(0, 2)]["all_gather"]`: bytes this rank sent
    in each process group (keyed by the group's ranks), per collective kind; `m.meter` is the
    engine's meter with the totals."""

    def __enter__(self) -> _GroupMeter:
        self._m = _GroupMeter()
        self._m.meter.__enter__()
        return self._m

    def __exit__(self, *exc: Any) -> None:
        self._m.meter.__exit__(*exc)
