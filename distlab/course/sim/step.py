"""One training step of a strategy, measured on a rank: the same function on real gloo ranks and in a simulation.

    out = measure_step("zero3", config, {"ZeRO3": ZeRO3}, batch_size=8)   # on every rank
    out.model_state, out.peak_bytes, out.comm

The strategies are built as chapters 2-6 build them (`build`), on the course GPT born in bf16
(`bf16_model`); `track_memory`, `model_state` and `track_comm` measure them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.course.data_parallel.measure import Strategy
from distlab.course.models import GPTConfig, num_params as count_params, split_batch, synthetic_batch
from distlab.course.sim.world import device_mesh, fake_ddp_hook
from distlab.engine.precision import MixedPrecisionAdam
from distlab.meters import CommStats, ModelState, model_state, track_comm, track_memory

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
# The lab class each strategy needs from the learner (or the shipped solution).
LAB_CLASS = {"zero1": ("03_zero1", "ShardedOptimizer"), "zero2": ("04_zero2", "ZeRO2"),
             "zero3": ("05_zero3", "ZeRO3")}
LR = 1e-3

# Shapes of the source notes' models by size (hidden h, layers L, heads), GPT-3 / Llama-like.
_SHAPES = ((2e7, 256, 4, 4), (2e8, 768, 12, 12), (6e8, 1024, 24, 16), (1.5e9, 2048, 24, 16), (4e9, 3072, 32, 24), (1e10, 4096, 36, 32), (2e10, 5120, 40, 40),
           (4e10, 6656, 60, 52), (1e11, 8192, 80, 64), (float("inf"), 12288, 96, 96))


def scale_config(num_params: float, *, seq_len: int = 2048, d_model: int | None = None,
                 n_layers: int | None = None, n_heads: int | None = None) -> GPTConfig:
    """A course GPT with about `num_params` parameters: a known shape for its size (7.5B: h = 4096,
    36 layers, 32 heads, the calculator's), and the vocabulary that makes up the rest.

    Ψ = L (12 h² + 13 h) + (2 V + S + 2) h  (blocks, token embedding and head, positions, final norm).
    """
    shape = next(s for s in _SHAPES if num_params <= s[0])
    h, layers, heads = d_model or shape[1], n_layers or shape[2], n_heads or shape[3]
    per_layer = 12 * h * h + 13 * h
    rest = num_params - (seq_len + 2) * h
    layers = min(layers, max(1, int(rest // per_layer)))   # small targets: fewer layers
    vocab = max(64, round((rest - layers * per_layer) / (2 * h)))
    return GPTConfig(vocab_size=vocab, seq_len=seq_len, d_model=h, n_layers=layers, n_heads=heads)


# ---- the strategies, as the chapters build them -------------------------------------------------------------

@dataclass
class Built:
    """A strategy ready to train, and what holds its model states on this rank."""

    strategy: Strategy
    params: Any        # what holds the parameters (the model, or ZeRO-3's shards)
    grads: Any = None  # what holds the gradients, when not the parameters' .grad (ZeRO-2's shards)


def build(name: str, model: nn.Module, classes: dict[str, Any] | None = None, *,
          bucket_size_mb: float = 25.0) -> Built:
    """Wrap a bf16 `model` as chapter 2-6 do: DDP and ZeRO-1/2 with `MixedPrecisionAdam` (K = 12),
    ZeRO-3 with fp32 AdamW on its fp32 shards, FSDP2 (`fully_shard` per block) with `MixedPrecisionAdam`
    on the DTensor shards. `classes` maps the lab class names (ShardedOptimizer, ZeRO2, ZeRO3) to the
    learner's classes."""
    classes = classes or {}
    if name in LAB_CLASS and LAB_CLASS[name][1] not in classes:
        lab, cls = LAB_CLASS[name]
        raise ValueError(f"strategy {name!r} runs your {cls} class from lab {lab}: pass classes={{'{cls}': {cls}}}")
    if name == "ddp":
        from distlab.course.data_parallel.ddp import TorchDDP
        ddp = TorchDDP(model, bucket_cap_mb=bucket_size_mb, gradient_as_bucket_view=True)
        if dist.get_backend() == "fake":
            ddp.register_comm_hook(None, fake_ddp_hook)
        return Built(Strategy(ddp, MixedPrecisionAdam(model.parameters(), lr=LR)), model)
    if name == "zero1":
        opt = classes["ShardedOptimizer"](model.parameters(), MixedPrecisionAdam, lr=LR)
        return Built(Strategy(model, opt), model)
    if name == "zero2":
        opt = classes["ZeRO2"](model.parameters(), MixedPrecisionAdam, bucket_size_mb=bucket_size_mb, lr=LR)
        return Built(Strategy(model, opt, state_of=opt.optim), model, grads=[b.grad_shard for b in opt.buckets])
    if name == "zero3":
        z = classes["ZeRO3"](model, optimizer=lambda shards: torch.optim.AdamW(shards, lr=LR),
                             gather_dtype=torch.bfloat16)
        return Built(Strategy(z, z.optimizer), z.shards())
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        m = device_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=m)
        fully_shard(model, mesh=m)
        return Built(Strategy(model, MixedPrecisionAdam(model.parameters(), lr=LR)), model)
    raise ValueError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")


def bf16_model(config: GPTConfig, seed: int = 0) -> nn.Module:
    """The course GPT born in bf16 (no fp32 copy first), on the rank's device; in a simulation on the
    fake CPU as it is born (`Module.to` cannot move fake parameters, and has nowhere to move them)."""
    from distlab.course.models import GPT
    from distlab.engine.runtime import device
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(config)
    finally:
        torch.set_default_dtype(default)
    return model if dist.is_initialized() and dist.get_backend() == "fake" else model.to(device())


# ---- one step, measured (the same function on real ranks and in a simulation) ---------------------------------

@dataclass(frozen=True)
class StepBytes:
    """What one rank measured over a training step (bytes).

    model_state: params / grads / optimizer state alive at the step boundary (after step(), before zero_grad);
    peak_bytes: the most bytes alive during the measured step (model states, activations, gathered units,
      buckets and temporaries included); comm: calls and algorithmic bytes sent per collective in that step.
    """

    model_state: ModelState
    peak_bytes: int
    comm: CommStats
    num_params: int


def measure_step(name: str, config: GPTConfig, classes: dict[str, Any] | None = None, *,
                 batch_size: int, bucket_size_mb: float = 25.0, steps: int | None = None) -> StepBytes:
    """On every rank (real or fake): build the bf16 course model and `name`, train on the rank's slice
    of a `batch_size`-row batch; the figures of the last of `steps` steps (default 2: the first creates
    the optimizer states; with steps=1 the model states at its end are the same, and its peak includes
    their birth).

    DDP is measured on its first step: before its second forward it re-orders its buckets by the order
    gradients arrived, agreeing on it across ranks by reading a broadcast tensor's data, which a fake
    run does not have. Its optimizer states are born inside that step (they are alive at its end).
    """
    steps = 1 if name == "ddp" else (steps or 2)
    from distlab.engine import runtime as rt
    fake = dist.get_backend() == "fake"
    with track_memory("cpu" if fake else None) as mem:
        model = bf16_model(config)
        psi = count_params(model)
        built = build(name, model, classes, bucket_size_mb=bucket_size_mb)
        s = built.strategy
        for step in range(steps):
            x, y = split_batch(synthetic_batch(step, batch_size, config, device="cpu" if fake else None),
                               rt.rank(), rt.world_size())
            if step == steps - 1:
                mem.reset_peak()
            with track_comm() as comm:
                s.step(x, y)
            if step == steps - 1:
                state = model_state(built.params, grads=built.grads, optimizer=s.state_of or s.optimizer)
                peak = mem.peak_bytes
            s.zero_grad()
    return StepBytes(state, peak, comm.stats(), psi)


def measure_steps(names: list[str], config: GPTConfig, classes: dict[str, Any] | None = None, *,
                  batch_size: int, bucket_size_mb: float = 25.0) -> dict[str, StepBytes]:
    """On every rank of a real launch: `measure_step` for each strategy in `names`, one after another
    (what a simulation of the same world size is compared with)."""
    return {name: measure_step(name, config, classes, batch_size=batch_size, bucket_size_mb=bucket_size_mb)
            for name in names}
