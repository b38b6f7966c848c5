"""Chapter 10's mixture-of-experts layer, in one process: the router, top-k gates, capacity, the two router
losses, and the course GPT with MoE blocks. The reference every expert-parallel version is compared with.

    moe = MoE(d_model=32, d_ff=64, n_experts=4, k=2, capacity_factor=1.25)
    y = moe(x)                       # x (B, S, h) -> (B, S, h)
    moe.stats.aux_loss, moe.stats.z_loss, moe.stats.assigned, moe.stats.kept

Routing (`route`): softmax over the E experts, the k largest probabilities, renormalised over those k
(Mixtral's gate: the same as a softmax over the k chosen logits). With a capacity C, each expert takes at
most C (token, choice) assignments, first come first served in a fixed priority: every token's first
choice in token order, then every token's second choice, ... (GShard, Switch): a token loses its second
choice before any token loses its first. A dropped assignment contributes nothing (the residual stream
carries the token past the layer).

The layer routes each group of `group_size` consecutive tokens on its own (capacity per group): one process
with group_size = a rank's tokens computes exactly what expert-parallel ranks compute, each on its own batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.course.models import GPT, Block, GPTConfig, Linear, PRESETS, _device


def capacity(tokens: int, k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """Slots per expert for `tokens` tokens: ceil(cf x tokens x k / E); None (dropless) when cf is None."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / n_experts)


def route(logits: torch.Tensor, k: int, capacity: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with an optional capacity per expert.

    logits (T, E) -> expert (T, k) long: the chosen experts, best first; weight (T, k): their gates
    (softmax probabilities renormalised over the k); slot (T, k) long: the assignment's position in its
    expert's buffer in priority order (all first choices in token order, then all second choices, ...),
    -1 when the expert was already full (dropped).
    """
    t, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    weight, expert = probs.topk(k, dim=-1)                       # (T, k)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    order = expert.t().reshape(-1)                               # (k T,): priority order, choice-major
    onehot = F.one_hot(order, e)                                 # (k T, E)
    pos = (onehot.cumsum(0) - 1).gather(1, order[:, None])[:, 0]  # how many came before, same expert
    slot = pos.view(k, t).t().contiguous()
    if capacity is not None:
        slot = torch.where(slot < capacity, slot, torch.full_like(slot, -1))
    return expert, weight.to(logits.dtype), slot


def load_balancing_loss(logits: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E x sum_e f_e P_e: f_e the fraction of the T x k assignments
    routed to expert e (before capacity; no gradient), P_e the mean router probability of e. 1.0 when
    routing is uniform; E when every token picks the same expert with certainty."""
    t, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    f = torch.bincount(expert.reshape(-1), minlength=e).to(probs.dtype) / expert.numel()
    return e * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return logits.float().logsumexp(dim=-1).pow(2).mean()


@dataclass
class RouterStats:
    """What the last forward routed: per group (rows) and expert (columns), assignments before and after
    capacity; the two losses (averaged over groups)."""

    assigned: torch.Tensor     # (G, E) long
    kept: torch.Tensor         # (G, E) long
    aux_loss: torch.Tensor
    z_loss: torch.Tensor

    @property
    def dropped(self) -> int:
        return int((self.assigned - self.kept).sum())


class Expert(nn.Module):
    """One expert: the course GPT's MLP (h -> d_ff, GeLU, d_ff -> h)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = Linear(d_model, d_ff)
        self.out = Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


def expert_rows(expert: torch.Tensor, slot: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, choice) of expert e's kept assignments, in slot order."""
    tok, choice = ((expert == e) & (slot >= 0)).nonzero(as_tuple=True)
    order = slot[tok, choice].argsort()
    return tok[order], choice[order]


class MoE(nn.Module):
    """A mixture of `n_experts` MLPs, `k` of them per token, in one process."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 2,
                 capacity_factor: float | None = None, group_size: int | None = None) -> None:
        super().__init__()
        self.n_experts, self.k, self.capacity_factor, self.group_size = n_experts, k, capacity_factor, group_size
        self.router = Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                             # (T, h)
        g = self.group_size or x.shape[0]
        outs, assigned, kept, aux, z = [], [], [], [], []
        for xs in x.split(g):
            logits = self.router(xs)
            cap = capacity(xs.shape[0], self.k, self.n_experts, self.capacity_factor)
            expert, weight, slot = route(logits, self.k, cap)
            y = torch.zeros_like(xs)
            for e, mlp in enumerate(self.experts):
                tok, choice = expert_rows(expert, slot, e)   # an idle expert runs on 0 rows: zero gradients
                y = y.index_add(0, tok, mlp(xs[tok]) * weight[tok, choice, None])
            outs.append(y)
            assigned.append(torch.bincount(expert.reshape(-1), minlength=self.n_experts))
            kept.append(torch.bincount(expert[slot >= 0], minlength=self.n_experts))
            aux.append(load_balancing_loss(logits, expert))
            z.append(router_z_loss(logits))
        self.stats = RouterStats(torch.stack(assigned), torch.stack(kept), torch.stack(aux).mean(),
                                 torch.stack(z).mean())
        return torch.cat(outs).view(shape)


# ---- the course GPT with MoE blocks -------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 4
    k: int = 2
    capacity_factor: float | None = None
    d_ff: int | None = None          # each expert's hidden size (default: the GPT's 4h)
    group_size: int | None = None


class MoEBlock(Block):
    """The course GPT's block with its MLP replaced by a mixture of experts."""

    def __init__(self, c: GPTConfig, m: MoEConfig) -> None:
        super().__init__(c)
        del self.fc, self.out
        self.moe = MoE(c.d_model, m.d_ff or c.d_ff, m.n_experts, m.k, m.capacity_factor, m.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distlab.engine.precision import compute_dtype
        x = x.to(compute_dtype(x.dtype, x.device))
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    def __init__(self, config: GPTConfig, moe: MoEConfig) -> None:
        super().__init__(config)
        self.moe_config = moe
        self.blocks = nn.ModuleList(MoEBlock(config, moe) for _ in range(config.n_layers))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


def build_moe_model(preset: str | GPTConfig = "tiny", moe: MoEConfig = MoEConfig(), *, seed: int = 0,
                    device: torch.device | str | None = None) -> MoEGPT:
    """The same weights for the same seed, everywhere; on `device` (default: the rank's)."""
    config = PRESETS[preset] if isinstance(preset, str) else preset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MoEGPT(config, moe)
    return model.to(_device(device))


def moe_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, aux_weight: float = 0.01,
             z_weight: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy plus the router losses of every MoE layer (weights as in Switch / ST-MoE)."""
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    for m in (m for m in model.modules() if isinstance(m, MoE) or hasattr(m, "stats")):
        if getattr(m, "stats", None) is not None and (aux_weight or z_weight):
            loss = loss + aux_weight * m.stats.aux_loss + z_weight * m.stats.z_loss
    return loss


def param_counts(model: nn.Module, k: int) -> tuple[int, int]:
    """(total, active) parameters: active = what one token's forward uses (k experts of each MoE layer)."""
    total = sum(p.numel() for p in model.parameters())
    experts = [m for m in model.modules() if isinstance(m, MoE)]
    idle = sum(sum(p.numel() for p in m.experts.parameters()) * (m.n_experts - k) // m.n_experts for m in experts)
    return total, total - idle
