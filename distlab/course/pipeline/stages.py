"""Pipeline stages of the course GPT: the model cut into p stages, and what crosses between them.

    stage = build_stage("tiny", index=r, stages=p)          # on distlab.device()
    h = stage(x)                     # stage 0: token ids -> hidden; last stage: hidden -> logits
    shape = activation_shape(stage.config, micro_batch=2)   # what crosses between stages

The package holds no schedule: GPipe and 1F1B are the chapter's lab. It holds
what every schedule needs: the model cut into stages that share the full
model's parameters, name for name (so gradients compare with one process), the
activation that crosses between neighbours, and the bytes a stage keeps for
backward. Its neighbours: `fixed_cost` (a fixed cost standing in for GPU
kernels) and `bubble` (the bubble read off a timeline).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlab.course.collectives import chunk_bounds
from distlab.course.models import GPT, GPTConfig, build_model


def stage_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) of the blocks each stage runs: contiguous, sizes differing by at most one."""
    if stages < 1 or stages > n_layers:
        raise ValueError(f"cannot cut {n_layers} blocks into {stages} stages: "
                         f"use 1..{n_layers} stages, or a model with more layers (n_layers=...)")
    return chunk_bounds(n_layers, stages)


class Stage(nn.Module):
    """Stage `index` of `stages`: blocks [a, b) of a GPT; embeddings on the first, the final norm
    and the head on the last. Shares the parameters of `model` (no copy).

    `full_names[local_name]` is each parameter's name in the whole model.
    """

    def __init__(self, model: GPT, index: int, stages: int) -> None:
        super().__init__()
        if not 0 <= index < stages:
            raise ValueError(f"stage index must be in 0..{stages - 1}, got {index}")
        self.config: GPTConfig = model.config
        self.index, self.stages = index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        a, b = stage_layers(model.config.n_layers, stages)[index]
        self.first_block = a
        if self.is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[a:b])
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head
        self.full_names = {name: self._full(name) for name, _ in self.named_parameters()}

    def _full(self, name: str) -> str:
        if name.startswith("blocks."):
            i, rest = name.split(".", 2)[1:]
            return f"blocks.{self.first_block + int(i)}.{rest}"
        return name

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        from distlab.engine.precision import compute_dtype
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return x.to(compute_dtype(x.dtype, x.device))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T) -> hidden (B, T, D); others: hidden -> hidden, or logits (B, T, V) last."""
        return self.body(self.embed(x) if self.is_first else x)


def build_stage(preset: str | GPTConfig = "tiny", index: int = 0, stages: int = 1, *, seed: int = 0,
                device: torch.device | str | None = None, **overrides: object) -> Stage:
    """Stage `index` of the course GPT cut in `stages`, with the same weights as `build_model(preset, seed=seed)`."""
    return Stage(build_model(preset, seed=seed, device=device, **overrides), index, stages)


def activation_shape(config: GPTConfig, micro_batch: int) -> tuple[int, int, int]:
    """(micro_batch, seq_len, d_model): the tensor one stage sends the next, and its gradient back."""
    return (micro_batch, config.seq_len, config.d_model)


def activation_dtype(config: GPTConfig, device: torch.device | str | None = None,
                     storage: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of the hidden states between stages: the compute dtype of the model's weights."""
    from distlab.engine.precision import compute_dtype
    return compute_dtype(storage, device)


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (what `distlab.course.models.lm_loss` computes)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def activation_bytes(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes one micro-batch's forward leaves alive on `stage` until its backward: the activations
    autograd saves, the stage's output (on the last stage, the loss and what it saves).

    `x`: one micro-batch of token ids (used by the first stage), `y`: its targets (used by the
    last); other stages get a random hidden state of the right shape. Measured with
    `distlab.meters.track_memory` after one untimed forward and backward (workspaces, lazy state).
    """
    from distlab.meters import track_memory
    from distlab.engine.runtime import device
    config = stage.config

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        inp = x if stage.is_first else torch.randn(
            activation_shape(config, x.shape[0]), device=device(),
            dtype=activation_dtype(config)).requires_grad_()
        out = stage(inp)
        return inp, (stage_loss(out, y) if stage.is_last else out)

    inp, out = forward()
    out.sum().backward()
    del inp, out
    with track_memory() as mem:
        inp, out = forward()
        held = mem.current_bytes
    del inp, out
    stage.zero_grad(set_to_none=True)
    return int(held)


def backward_transient_bytes(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes above one micro-batch's activations while its backward runs on `stage`: the received
    gradient buffer (the activation's shape; none on the last stage, whose backward starts from its
    loss), the matrix products' temporaries, the input gradient on its way out. A pipeline's peak is
    the micro-batches it holds plus this transient of the one backward in progress.
    Measured like `activation_bytes`: peak of forward + backward minus what the forward left alive.
    """
    from distlab.meters import track_memory
    from distlab.engine.runtime import device
    config = stage.config
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)                      # accumulated in place, as in a pipeline's step
    for _ in range(2):                                    # the first pass makes lazy state
        inp = x if stage.is_first else torch.randn(
            activation_shape(config, x.shape[0]), device=device(), dtype=activation_dtype(config)).requires_grad_()
        with track_memory() as mem:
            out = stage(inp)
            if stage.is_last:
                out = stage_loss(out, y)
            held = mem.current_bytes
            if stage.is_last:
                out.backward()
            else:
                out.backward(torch.randn(out.shape, device=out.device, dtype=out.dtype))
            peak = mem.peak_bytes
        del inp, out
    stage.zero_grad(set_to_none=True)
    return int(peak - held)
