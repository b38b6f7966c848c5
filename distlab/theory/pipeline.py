"""Closed forms for pipelines, ZeRO-Offload and 3-D layouts. Pure functions, no ranks.

Names: p = pipeline stages (ranks in a pipeline), m = micro-batches per step,
v = model chunks per rank (interleaved schedules), Ψ = `num_params`,
dp / tp / pp = the data-, tensor- and pipeline-parallel degrees.

    bubble_fraction(4, 8)            # 3/11: GPipe and 1F1B idle that share of a step
    bubble_fraction(4, 8, v=2)       # 1.5/9.5: interleaving divides the bubble by v
    memory_3d(70e9, dp=8, tp=8, pp=4, zero=1)    # (4 + 12/dp) Ψ/(tp·pp) bytes per GPU
"""
from __future__ import annotations

from dataclasses import dataclass


def _check_pm(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages p, micro-batches m and chunks v must be >= 1, got p={p}, m={m}, v={v}")


# ---- the bubble ------------------------------------------------------------------------------------

def step_time(p: int, m: int, t_forward: float, t_backward: float, v: int = 1) -> float:
    """Time of one pipelined step with equal stages and free communication.

    GPipe and 1F1B: (m + p - 1)(t_f + t_b) for a stage's forward t_f and backward t_b
    of one micro-batch. Interleaved (v chunks per rank, each 1/v of the stage):
    (m + (p - 1)/v)(t_f + t_b): the ramp is made of chunks v times shorter.
    """
    _check_pm(p, m, v)
    return (m + (p - 1) / v) * (t_forward + t_backward)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Share of a step each rank idles: (p - 1)/(m + p - 1) for GPipe and 1F1B, and
    ((p - 1)/v)/(m + (p - 1)/v) for the interleaved schedule (the bubble time divided by v)."""
    _check_pm(p, m, v)
    ramp = (p - 1) / v
    return ramp / (m + ramp)


def bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over useful time, (p - 1)/(v m) (the Megatron-LM paper's measure)."""
    _check_pm(p, m, v)
    return (p - 1) / (v * m)


def zero_bubble_fraction(p: int, m: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle share of a step for ZB-H1 (Qi et al., 2023), whose backward is split in B (input
    gradient) and W (weight gradient): the ramp costs (p - 1)(t_f + t_b - t_w) instead of
    (p - 1)(t_f + t_b + t_w), about a third of 1F1B's when t_f = t_b = t_w."""
    _check_pm(p, m)
    work = m * (t_f + t_b + t_w)
    ramp = (p - 1) * max(t_f + t_b - t_w, 0.0)
    return ramp / (work + ramp)


def micro_batches_for_bubble(p: int, target: float, v: int = 1) -> int:
    """Smallest m whose bubble fraction is at most `target` (0 < target < 1)."""
    if not 0 < target < 1:
        raise ValueError(f"target bubble fraction must be in (0, 1), got {target}")
    _check_pm(p, 1, v)
    ramp = (p - 1) / v
    m = max(1, int(ramp * (1 - target) / target))
    while bubble_fraction(p, m, v) > target:
        m += 1
    while m > 1 and bubble_fraction(p, m - 1, v) <= target:
        m -= 1
    return m


# ---- activations -----------------------------------------------------------------------------------

def activations_in_flight(schedule: str, p: int, m: int, stage: int, v: int = 1) -> float:
    """Micro-batches whose activations stage `stage` (0-based) holds at its peak.

    GPipe runs every forward before any backward: m. 1F1B starts backwards after a warm-up of
    p - stage - 1 forwards, so it holds min(m, p - stage) (the first stage holds the most).
    Interleaved 1F1B (Megatron-LM's warm-up count) runs 2(p - stage - 1) + (v - 1)p chunk
    forwards before its first backward, each chunk 1/v of the stage: in units of one
    micro-batch through the whole stage, min(m, (2(p - stage - 1) + (v - 1)p + 1)/v).
    """
    _check_pm(p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, got {stage}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - stage))
    if schedule == "interleaved":
        return min(float(m), (2 * (p - stage - 1) + (v - 1) * p + 1) / v)
    raise ValueError(f"unknown schedule {schedule!r}; choose gpipe, 1f1b or interleaved")


def peak_activations(schedule: str, p: int, m: int, stage: int, transient: float = 0.0, v: int = 1) -> float:
    """A stage's peak memory in micro-batches of activations: the micro-batches in flight at the
    peak (`activations_in_flight`) plus `transient`, the bytes one backward adds while it runs (the
    received gradient buffer, the matrix products' temporaries, the input gradient on its way out),
    in units of one micro-batch's activations. The peak falls inside a backward: every schedule
    runs one while holding its most. Measure `transient` apart
    (`distlab.course.pipeline.stages.backward_transient_bytes`)."""
    if transient < 0:
        raise ValueError(f"transient must be >= 0 micro-batches, got {transient}")
    return activations_in_flight(schedule, p, m, stage, v) + transient


def global_batch(dp: int, m: int, micro_batch: int) -> int:
    """Samples per optimizer step: every data-parallel replica runs m micro-batches."""
    if min(dp, m, micro_batch) < 1:
        raise ValueError(f"dp, m and micro_batch must be >= 1, got {dp}, {m}, {micro_batch}")
    return dp * m * micro_batch


# ---- ZeRO-Offload ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Offload:
    """Bytes per step across the host link and bytes held on each side (ZeRO-Offload)."""

    down_bytes: float         # device -> host: the 16-bit gradients, 2Ψ
    up_bytes: float           # host -> device: the updated 16-bit parameters, 2Ψ
    device_bytes: float       # 16-bit parameters kept on the device, 2Ψ (gradients leave as they are made)
    host_bytes: float         # 16-bit gradients 2Ψ + fp32 master, m, v 12Ψ = 14Ψ


def offload(num_params: float, low_bytes: float = 2, k: float = 12) -> Offload:
    """ZeRO-Offload's split: parameters stay on the device, the optimizer lives on the host."""
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    low = low_bytes * num_params
    return Offload(low, low, low, low + k * num_params)


# ---- 3-D layouts -----------------------------------------------------------------------------------

def memory_3d(num_params: float, dp: int, tp: int, pp: int, zero: int = 1,
              param_bytes: float = 2, grad_bytes: float = 2, k: float = 12) -> float:
    """Model-state bytes per device when Ψ is split evenly over tp x pp and ZeRO runs over dp.

    zero 0: 16Ψ/(tp pp)                  zero 1: (4 + 12/dp) Ψ/(tp pp)
    zero 2: (2 + 14/dp) Ψ/(tp pp)        zero 3: 16Ψ/(dp tp pp)
    (mixed-precision Adam: 2 + 2 + K with K = 12).
    """
    if min(dp, tp, pp) < 1:
        raise ValueError(f"dp, tp and pp must be >= 1, got {dp}, {tp}, {pp}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {zero}")
    local = num_params / (tp * pp)
    p, g, o = param_bytes * local, grad_bytes * local, k * local
    return {0: p + g + o, 1: p + g + o / dp, 2: p + (g + o) / dp, 3: (p + g + o) / dp}[zero]


def dp_bytes(local_params: float, dp: int, zero: int = 1, bytes_per_element: float = 2, m: int = 1) -> float:
    """Bytes one rank sends per step in its data-parallel group for its Ψ_local parameters,
    when a step runs `m` micro-batches (pipelined or accumulated):

    ZeRO 0-1: gradients accumulate whole and are reduced once: 2Ψ(dp-1)/dp (all-reduce, or
    reduce-scatter + all-gather). ZeRO-2 keeps only a gradient shard, so it reduce-scatters after
    every micro-batch and all-gathers the parameters once: (m + 1)Ψ(dp-1)/dp. ZeRO-3 gathers the
    parameters for every micro-batch's forward and backward and reduce-scatters every time:
    3mΨ(dp-1)/dp (3Ψ(dp-1)/dp for one micro-batch).
    """
    if dp < 1 or m < 1:
        raise ValueError(f"dp and m must be >= 1, got dp={dp}, m={m}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {zero}")
    volumes = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[zero]
    return volumes * local_params * bytes_per_element * (dp - 1) / dp


def tp_bytes(activation_elements: float, all_reduces: int, tp: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank sends in its tensor-parallel group: `all_reduces` all-reduces of an
    activation of `activation_elements` (b s h per micro-batch), each 2(tp-1)/tp of it.
    Megatron's block does 2 in the forward (after attention and after the MLP) and 2 in the backward."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return all_reduces * activation_elements * bytes_per_element * 2 * (tp - 1) / tp


def pp_bytes(activation_elements: float, m: int, stage: int, pp: int, bytes_per_element: float = 2) -> float:
    """Bytes stage `stage` sends per step: its output activation forward (not the last stage)
    and the gradient of its input backward (not the first), once per micro-batch."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in 0..{pp - 1}, got {stage}")
    links = (stage < pp - 1) + (stage > 0)
    return links * m * activation_elements * bytes_per_element
