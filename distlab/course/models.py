"""The course model: a small GPT-style decoder, deterministic data, a reference trainer.

Every strategy in the course (DDP, ZeRO-1/2/3, FSDP) trains this model on the
same synthetic batches and is compared with `train_reference`, one process
on the full batch.

    model = build_model("tiny", seed=0)                   # on distlab.device()
    x, y = synthetic_batch(step=0, batch_size=8, config=model.config)
    loss = lm_loss(model, x, y)

Placement: inside a rank, `build_model` and `synthetic_batch` put their
tensors on `distlab.device()` (the rank's GPU under NCCL, the CPU under gloo);
outside a rank, on the CPU.

Precision: the weights may be stored in bf16 (2 bytes, the recipe's figure)
while the matrix products run in the fastest dtype this device has for them
(`distlab.engine.precision.compute_dtype`): bf16 on GPUs and on CPUs with native
bf16, fp32 on the others, where bf16 arithmetic is emulated and ~50x slower.
The weights are cast on the fly, so parameter, gradient and traffic bytes
stay those of the storage dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    tie_weights: bool = False

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


PRESETS: dict[str, GPTConfig] = {
    # ~34k params: tests, well under a second a step on a CPU.
    "tiny": GPTConfig(vocab_size=128, seq_len=16, d_model=32, n_layers=2, n_heads=2),
    # ~0.55M params: notebooks in quick mode.
    "small": GPTConfig(vocab_size=512, seq_len=64, d_model=96, n_layers=4, n_heads=4),
    # ~10.6M params: model states dominate memory; ZeRO figures.
    "medium": GPTConfig(vocab_size=2048, seq_len=128, d_model=256, n_layers=12, n_heads=8),
    # ~98M params (GPT-2 small's shape with a small vocabulary): GPU runs.
    "large": GPTConfig(vocab_size=8192, seq_len=256, d_model=768, n_layers=12, n_heads=12),
}


class Linear(nn.Linear):
    """nn.Linear that computes in its input's dtype (weights cast on the fly, gradients cast back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that computes in its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class Block(nn.Module):
    """One transformer block: the unit FSDP/ZeRO-3 gathers at once."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = LayerNorm(c.d_model)
        self.qkv = Linear(c.d_model, 3 * c.d_model)
        self.proj = Linear(c.d_model, c.d_model)
        self.ln2 = LayerNorm(c.d_model)
        self.fc = Linear(c.d_model, c.d_ff)
        self.out = Linear(c.d_ff, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distlab.engine.precision import compute_dtype
        # FSDP2's MixedPrecisionPolicy casts a unit's inputs to its param_dtype (bf16): compute in the
        # device's dtype for it (fp32 where bf16 is emulated); the gathered weights stay bf16.
        x = x.to(compute_dtype(x.dtype, x.device))
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (B, T, D) -> (B, nh, T, hs)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = LayerNorm(config.d_model)
        self.head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok.weight  # one parameter, two uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from distlab.engine.precision import compute_dtype
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = x.to(compute_dtype(x.dtype, x.device))  # bf16 storage, fp32 math where bf16 is emulated
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def num_params(model: nn.Module) -> int:
    """Ψ: distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def _device(device: torch.device | str | None) -> torch.device:
    """`device`, or this rank's device (`distlab.device()`; the CPU outside a rank)."""
    if device is not None:
        return torch.device(device)
    from distlab.engine.runtime import device as rank_device
    return rank_device()


def build_model(preset: str | GPTConfig = "tiny", *, seed: int = 0, device: torch.device | str | None = None,
                **overrides: object) -> GPT:
    """The same weights for the same seed, on every rank and every run; on `device` (default: the rank's)."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        config = PRESETS[preset]
    else:
        config = preset
    config = replace(config, **overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return model.to(_device(device))


def synthetic_batch(step: int, batch_size: int, config: GPTConfig, *, seed: int = 0,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (x, y) token batches that a model can learn.

    Each row counts from a random start with a random stride (mod vocab), so
    the next token follows from the previous two and the loss falls.
    Rows depend only on (seed, step, row): splitting a batch across ranks
    gives each rank exactly its slice of the full batch. Made on the CPU (the
    same numbers on every machine), then placed on `device` (default: the rank's).
    """
    g = torch.Generator().manual_seed(1_000_003 * seed + step)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    seq = (start + stride * torch.arange(config.seq_len + 1)) % config.vocab_size
    dev = _device(device)
    return seq[:, :-1].to(dev), seq[:, 1:].to(dev)


def split_batch(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s contiguous slice of B/N rows of every tensor in `batch`."""
    b = batch[0].shape[0]
    if b % world_size:
        raise ValueError(f"batch size {b} does not split evenly over {world_size} ranks; "
                         f"use a multiple of {world_size}")
    per = b // world_size
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@dataclass
class Reference:
    losses: list[float]
    params: dict[str, torch.Tensor]


def train_reference(preset: str | GPTConfig = "tiny", *, steps: int, batch_size: int, lr: float = 1e-2,
                    seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                    **overrides: object) -> Reference:
    """One process, full batch: the ground truth every strategy must reproduce (on the CPU)."""
    model = build_model(preset, seed=seed, device="cpu", **overrides)
    opt = optimizer(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, batch_size, model.config, seed=seed, device="cpu")
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return Reference(losses, {k: v.detach().clone() for k, v in model.named_parameters()})
