"""Tokens/s and MFU of a training run: the course's FLOP model applied to the course GPT.

    fpt = flops_per_token(cfg.model_config())           # 6 per matrix weight + 12 L d T (attention)
    mfu(run.tokens_per_s, fpt, gpus=run.world_size, peak_flops=gpu_peak_flops("NVIDIA H100 80GB HBM3"))
    throughput_line(run, single, cfg.model_config())     # what lecture 9 prints: ratios on a CPU, MFU on GPUs

MFU (model FLOPs utilisation, PaLM's definition) divides the FLOPs the model needs per trained token
(`distlab.theory.planning.model_flops_per_token`: recomputation does not count) times the tokens per second
by the GPUs' peak. The peak is the GPU's dense bf16 tensor-core figure (`distlab.theory.hardware`), the one
published MFUs use; this course's loop trains in fp32, so its MFU reads how far a run is from what the
hardware offers, not from what fp32 arithmetic could reach. On a CPU there is no peak worth quoting (a
laptop's cores are shared with the notebook and the other ranks): the lecture prints tokens/s as ratios
to one process there.
"""
from __future__ import annotations

from typing import Any

from distlab.course.models import GPTConfig
from distlab.theory.hardware import A100, GPU, H100
from distlab.theory.planning import model_flops_per_token

# Name fragments of the GPUs whose peaks the course knows (H200: H100's tensor cores, more memory).
KNOWN_GPUS: dict[str, GPU] = {"H100": H100, "H200": H100, "A100": A100}


def matmul_params(config: GPTConfig) -> int:
    """Every weight a matrix product uses: per block qkv (3d x d), proj (d x d), fc (d_ff x d), out (d x d_ff);
    the head (V x d). Not the embeddings (lookups) nor biases and LayerNorms (no product)."""
    d = config.d_model
    return config.n_layers * (4 * d * d + 2 * d * config.d_ff) + d * config.vocab_size


def flops_per_token(config: GPTConfig) -> float:
    """Forward and backward FLOPs per trained token: 6 per matrix weight plus attention's 12 L d T."""
    return model_flops_per_token(matmul_params(config), config.n_layers, config.d_model, config.seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: tokens/s x FLOPs per token / (GPUs x peak FLOP/s of one GPU)."""
    if gpus < 1 or peak_flops <= 0:
        raise ValueError(f"MFU needs at least one GPU and a positive peak, got {gpus} GPUs and {peak_flops} FLOP/s")
    return tokens_per_s * flops_per_token / (gpus * peak_flops)


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU called `name` (as `torch.cuda.get_device_name` says), or None
    when the course does not know it."""
    for fragment, gpu in KNOWN_GPUS.items():
        if fragment in name:
            return gpu.bf16_TFLOPs * 1e12
    return None


def throughput_line(run: Any, single: Any, config: GPTConfig) -> str:
    """`run`'s tokens/s as a ratio to the one-process `single` run; on GPUs also its tokens/s per GPU and
    its MFU against the GPU's bf16 peak (where the GPU is known)."""
    ratio = f"tokens/s = {run.tokens_per_s / single.tokens_per_s:.2f} x one process"
    if not getattr(run, "device", "cpu").startswith("cuda"):
        return ratio
    per_gpu = run.tokens_per_s / run.world_size
    peak = gpu_peak_flops(getattr(run, "device_name", ""))
    if peak is None:
        return f"{ratio}; {per_gpu:,.0f} tokens/s per GPU (MFU: peak of {run.device_name!r} unknown)"
    return (f"{ratio}; {per_gpu:,.0f} tokens/s per GPU, MFU "
            f"{mfu(run.tokens_per_s, flops_per_token(config), run.world_size, peak):.1%} of the bf16 peak")
