"""Closed forms the course draws beside its measurements. Pure functions, no ranks.
This module: bytes per parameter, ZeRO memory per stage, traffic, busbw; hardware, overlap, tensor_parallel, pipeline, planning (the layout planner's shapes, FLOPs, latencies).
May import: engine only (it needs nothing). Names: Ψ = `num_params`, N = `world_size` (the data-parallel degree),
K = bytes of optimizer state per parameter.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter a rank holds for one training recipe."""

    name: str
    param_bytes: int      # the weights the forward uses
    grad_bytes: int       # their gradients
    optimizer_bytes: int  # K: master copy + optimizer moments

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


# fp32 Adam: 4 (param) + 4 (grad) + 4 (m) + 4 (v).
FP32_ADAM = Recipe("fp32", 4, 4, 8)
# Mixed precision Adam: bf16 param 2 + bf16 grad 2 + fp32 master 4 + m 4 + v 4.
MIXED_ADAM = Recipe("mixed", 2, 2, 12)
RECIPES = {r.name: r for r in (FP32_ADAM, MIXED_ADAM)}


def bytes_per_param(recipe: str = "mixed") -> int:
    """16 for both fp32 Adam (4+4+8) and mixed-precision Adam (2+2+12)."""
    return _recipe(recipe).total


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]


def _check(num_params: float, world_size: int, stage: int) -> None:
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")


def zero_memory_per_device(num_params: float, world_size: int, stage: int, k: float = 12,
                           param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per device for ZeRO stage 0 (DDP) to 3 (ZeRO paper, eq. in §5).

    stage 0: (2 + 2 + K)Ψ       stage 1: (2 + 2)Ψ + KΨ/N
    stage 2: 2Ψ + (2 + K)Ψ/N    stage 3: (2 + 2 + K)Ψ/N
    """
    _check(num_params, world_size, stage)
    p, g, o, n = param_bytes * num_params, grad_bytes * num_params, k * num_params, world_size
    return {0: p + g + o, 1: p + g + o / n, 2: p + (g + o) / n, 3: (p + g + o) / n}[stage]


def largest_model(device_bytes: float, world_size: int, stage: int, k: float = 12,
                  param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Largest Ψ whose model states fit in `device_bytes` (activations not counted)."""
    per_param = zero_memory_per_device(1, world_size, stage, k, param_bytes, grad_bytes)
    return device_bytes / per_param


def comm_bytes_per_rank(num_params: float, world_size: int, stage: int,
                        bytes_per_element: float = 2) -> float:
    """Bytes each rank sends per training step.

    Stages 0-2: one all-reduce of the gradients, or the same bytes as
    reduce-scatter + all-gather: 2Ψ(N-1)/N. Stage 3 gathers parameters twice
    (forward and backward) and reduce-scatters gradients: 3Ψ(N-1)/N.
    """
    _check(num_params, world_size, stage)
    n = world_size
    volumes = 3 if stage == 3 else 2
    return volumes * num_params * bytes_per_element * (n - 1) / n


BUSBW_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")


def busbw_factor(op: str, world_size: int) -> float:
    """busbw = algbw x factor (nccl-tests' PERFORMANCE.md).

    all-reduce 2(N-1)/N; all-gather, reduce-scatter, all-to-all (N-1)/N;
    broadcast and reduce 1.
    """
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send"):
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op!r}; known: {BUSBW_OPS}")


def collective_bytes_sent(op: str, message_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective on a message of S bytes (ring algorithms).

    S is the whole message (nccl-tests' size): the all-reduce buffer, the
    gathered output of all-gather, the input of reduce-scatter.
    """
    if world_size == 1 or op in ("recv", "barrier"):
        return 0 if op != "send" else message_bytes
    return round(message_bytes * busbw_factor(op, world_size))


def algbw(message_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: S / t."""
    return message_bytes / seconds


def busbw(op: str, message_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s: comparable to the link's peak, whatever the op and N."""
    return algbw(message_bytes, seconds) * busbw_factor(op, world_size)


def alpha_beta_seconds(message_bytes: float, alpha_s: float, beta_bytes_per_s: float,
                       steps: int = 1) -> float:
    """Latency-bandwidth model: `steps` messages of latency alpha plus S / beta."""
    return steps * alpha_s + message_bytes / beta_bytes_per_s
