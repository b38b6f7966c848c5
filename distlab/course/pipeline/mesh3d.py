"""A pipeline stage inside a (pp, dp, tp) mesh: its blocks cut over the tp group, Megatron-style.

    mesh = distlab.mesh(2, 2, 2, names=MESH_ORDER)              # pp outermost, tp innermost
    stage = tp_stage(build_stage("tiny", s, pp), mesh.get_group("tp"))
    stage.cuts["blocks.0.qkv_w"]                                # ("blocks.0.qkv.weight", 0, 3): how it was cut

`TPBlock` runs the course block's arithmetic on rank t's slices: qkv (whole heads of Q, K and V) and
fc split by columns, proj and out by rows, with Megatron's f (identity forward, all-reduce of the
input gradient backward) before each column-parallel product and g (all-reduce forward, identity
backward) after each row-parallel one: 2 all-reduces of (b, s, d) per block in the forward, 2 in
the backward. LayerNorms and the row-parallel biases are replicated (their gradients come out equal
on every tp rank). Lab 8's 3-D task gets its stages from here; lecture 8 writes the same block.
`reference_bf16` is the one-process ground truth of lecture 8's 3-D training.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.course.models import build_model, lm_loss, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam

MESH_ORDER = ("pp", "dp", "tp")        # outermost first: the lightest traffic spans the slowest links


class _ToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward, all-reduce the input gradient over the tp group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromTP(torch.autograd.Function):
    """Megatron's g: forward, all-reduce the partial products over the tp group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def cut(w: torch.Tensor, t: int, tp: int, dim: int = 0, blocks: int = 1) -> torch.Tensor:
    """Rank t's 1/tp of `w` along `dim`, cut separately inside each of `blocks` equal blocks (q, k, v)."""
    pieces = w.detach().chunk(blocks, dim=dim)
    return torch.cat([c.chunk(tp, dim=dim)[t] for c in pieces], dim=dim)


# local name -> (the course Block's parameter, dim, blocks); absent: replicated (ln1, ln2, proj_b, out_b)
CUTS = {"qkv_w": ("qkv.weight", 0, 3), "qkv_b": ("qkv.bias", 0, 3), "proj_w": ("proj.weight", 1, 1),
        "fc_w": ("fc.weight", 0, 1), "fc_b": ("fc.bias", 0, 1), "out_w": ("out.weight", 1, 1)}


class TPBlock(nn.Module):
    """A course block over a tp group (see the module's docstring)."""

    def __init__(self, block: nn.Module, group: Any) -> None:
        super().__init__()
        tp, t = group.size(), group.rank()
        if block.n_heads % tp:
            raise ValueError(f"{block.n_heads} heads cannot be split over a tp group of {tp}")
        self.group, self.heads = group, block.n_heads // tp
        self.ln1, self.ln2, self.proj_b, self.out_b = block.ln1, block.ln2, block.proj.bias, block.out.bias
        for local, (full, dim, blocks) in CUTS.items():
            setattr(self, local, nn.Parameter(cut(block.get_parameter(full), t, tp, dim, blocks).clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = _ToTP.apply(self.ln1(x), self.group)
        q, k, v = F.linear(h, self.qkv_w, self.qkv_b).chunk(3, dim=2)
        q, k, v = (z.reshape(b, s, self.heads, -1).transpose(1, 2) for z in (q, k, v))   # my heads only
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + _FromTP.apply(F.linear(a, self.proj_w), self.group) + self.proj_b
        h = _ToTP.apply(self.ln2(x), self.group)
        y = F.linear(F.gelu(F.linear(h, self.fc_w, self.fc_b)), self.out_w)
        return x + _FromTP.apply(y, self.group) + self.out_b


_REPLICATED = {"ln1": "ln1", "ln2": "ln2", "proj_b": "proj.bias", "out_b": "out.bias"}


def tp_stage(stage: nn.Module, group: Any) -> nn.Module:
    """`stage` (a `Stage`, in place) with each block replaced by a `TPBlock` over `group`. Sets
    `stage.cuts[local name] = (name in the whole model, dim, blocks)` for every parameter: dim None
    where the parameter is replicated over tp (embeddings, LayerNorms, biases after g, the head)."""
    stage.blocks = nn.ModuleList(TPBlock(b, group) for b in stage.blocks)
    cuts = {}
    for name, _ in stage.named_parameters():
        if not name.startswith("blocks."):
            cuts[name] = (name, None, 1)
            continue
        _, i, local = name.split(".", 2)
        block = f"blocks.{stage.first_block + int(i)}"
        head, _, rest = local.partition(".")
        if head in CUTS:
            full, dim, blocks = CUTS[head]
            cuts[name] = (f"{block}.{full}", dim, blocks)
        else:
            cuts[name] = (f"{block}.{_REPLICATED[head]}{'.' + rest if rest else ''}", None, 1)
    stage.cuts = cuts
    return stage


def reference_bf16(steps: int, batch: int, lr: float, n_layers: int = 4) -> list[float]:
    """One process, the whole batch, the same bf16 weights and `MixedPrecisionAdam`, on the CPU: the ground
    truth for the lecture's 3-D training (`train_3d`, in the notebook). The loss of each step."""
    model = build_model("tiny", seed=0, n_layers=n_layers, device="cpu").to(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, batch, model.config, device="cpu")
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
