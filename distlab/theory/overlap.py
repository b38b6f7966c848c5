"""When can sharded data parallelism hide its communication behind compute? Pure arithmetic.

A training step on T tokens per GPU costs about 6ΨT FLOPs (forward 2ΨT,
backward 4ΨT). ZeRO-3 sends `passes` x b x Ψ(N-1)/N bytes per GPU per step
(two all-gathers and a reduce-scatter: passes = 3; DDP and ZeRO-1/2: 2).
With F the FLOP/s a GPU achieves and β the bytes/s its link moves, the wire
can keep up with the compute, so prefetching hides it, when

    6ΨT / F  >=  passes · b · Ψ (N-1)/N / β    <=>    T >= (passes · b / 6) · (N-1)/N · F / β

For ZeRO-3 in bf16 (passes 3, b 2) on many GPUs this is T >= F/β: the tokens
each GPU must process per step grow with the compute-to-bandwidth ratio of
the hardware, and Ψ cancels out.

    from distlab.theory.hardware import H100
    tokens_to_hide(H100, "nvlink")   # ~2,200 tokens per GPU per step inside a node
    tokens_to_hide(H100, "ib")       # ~19,800 across nodes (one NDR NIC per GPU)
"""
from __future__ import annotations

from distlab.theory.hardware import GPU


def step_flops(num_params: float, tokens: float) -> float:
    """FLOPs of one training step (forward + backward) of a dense model on `tokens` tokens: 6ΨT."""
    return 6.0 * num_params * tokens


def sharded_step_bytes(num_params: float, world_size: int, *, passes: int = 3, bytes_per_element: float = 2) -> float:
    """Bytes each GPU sends per step: passes x b x Ψ (N-1)/N (ZeRO-3: 3 passes; DDP, ZeRO-1/2: 2)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return passes * bytes_per_element * num_params * (world_size - 1) / world_size


def link_bytes_per_s(gpu: GPU, link: str) -> float:
    """Bytes/s per GPU, per direction: 'nvlink' inside a node, 'ib' across nodes."""
    if link == "nvlink":
        return gpu.nvlink_GBps * 1e9
    if link == "ib":
        return gpu.ib_GBps * 1e9
    raise ValueError(f"link must be 'nvlink' or 'ib', got {link!r}")


def tokens_to_hide(gpu: GPU, link: str, *, utilisation: float = 1.0, passes: int = 3,
                   bytes_per_element: float = 2, world_size: int | None = None) -> float:
    """Tokens per GPU per step above which compute lasts at least as long as the step's communication.

    `utilisation`: the fraction of the GPU's dense bf16 peak the model achieves (MFU);
    `world_size`: None for the large-N limit ((N-1)/N -> 1).
    """
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must lie in (0, 1], got {utilisation}")
    flops = utilisation * gpu.bf16_TFLOPs * 1e12
    frac = 1.0 if world_size is None else (world_size - 1) / world_size
    return passes * bytes_per_element / 6.0 * frac * flops / link_bytes_per_s(gpu, link)


def seconds(num_params: float, tokens: float, world_size: int, gpu: GPU, link: str, *,
            utilisation: float = 1.0, passes: int = 3, bytes_per_element: float = 2) -> tuple[float, float]:
    """(compute seconds, communication seconds) of one step per GPU, by the formulas above."""
    compute = step_flops(num_params, tokens) / (utilisation * gpu.bf16_TFLOPs * 1e12)
    comm = sharded_step_bytes(num_params, world_size, passes=passes,
                              bytes_per_element=bytes_per_element) / link_bytes_per_s(gpu, link)
    return compute, comm
