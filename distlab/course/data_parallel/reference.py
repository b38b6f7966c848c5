"""The data-parallel labs' test models and their single-process ground truth.

Chapters 2 and 3 check a learner's DDP and ZeRO-1 against one process that
trains the same model on the whole batch. Two variants of the course model
catch the classic mistakes:

- `"frozen"`: the position embedding has `requires_grad=False` (no gradient:
  it must be in no bucket, no shard, no optimizer);
- `"tied"`: the output head *is* the token embedding (one parameter, two
  uses: it appears once in `model.parameters()`, its gradient sums both).

    model = make_model("tied")                          # on the rank's device
    ref = train_single("tied", sgd, steps=4, batch_size=8)   # CPU, no ranks

Everything here runs without learner code: the checks' references come from it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from distlab.course.models import PRESETS, build_model, lm_loss, synthetic_batch

VARIANTS = ("plain", "frozen", "tied")


def make_model(variant: str = "plain", *, preset: str = "tiny", dtype: torch.dtype = torch.float32,
               seed: int = 0, device: torch.device | str | None = None) -> torch.nn.Module:
    """The course model in one of `VARIANTS`, stored in `dtype`, on `device` (default: the rank's)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    model = build_model(preset, seed=seed, device=device, tie_weights=(variant == "tied")).to(dtype)
    if variant == "frozen":
        model.pos.weight.requires_grad_(False)
    return model


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that gets a gradient, each once, in `parameters()` order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def sgd(params, lr: float = 0.5, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The checks' optimizer for gradients: SGD with momentum sees any error in the gradient's scale
    (Adam divides it away) and turns no rounding noise into a full step."""
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum)


@contextmanager
def one_thread() -> Iterator[None]:
    """Compute on one intra-op thread inside the block.

    References are small and run beside the ranks, which already use the
    cores: with torch's default (one thread per core) a 34k-parameter model
    trained 40x slower on a busy 2-core machine (measured: 11.7 s vs 0.25 s).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_single(variant: str, optimizer: Callable[..., torch.optim.Optimizer] = sgd, *, steps: int,
                 batch_size: int, preset: str = "tiny", dtype: torch.dtype = torch.float32,
                 seed: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One process, the whole batch: the parameters (as fp32, on the CPU) after `steps` steps.

    `optimizer(trainable_params)` builds the optimizer (e.g. `sgd`, or a
    `functools.partial` of any torch optimizer class). `device`: where to compute (a check whose
    tolerance is tight in bf16 computes its reference on the graded ranks' device: a GPU's bf16
    kernels round differently from a CPU's fp32 compute).
    """
    with one_thread():
        model = make_model(variant, preset=preset, dtype=dtype, seed=seed, device=device)
        opt = optimizer([p for _, p in trainable(model)])
        for step in range(steps):
            x, y = synthetic_batch(step, batch_size, PRESETS[preset], device=device)
            lm_loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}


def full_batch_gradient(variant: str, *, batch_size: int, preset: str = "tiny", step: int = 0,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One CPU process: the flat gradient of the mean loss over the whole batch of `step`,
    trainable parameters concatenated in `parameters()` order (what DDP's all-reduce averages to)."""
    with one_thread():
        model = make_model(variant, preset=preset, dtype=dtype, device="cpu")
        x, y = synthetic_batch(step, batch_size, PRESETS[preset], device="cpu")
        lm_loss(model, x, y).backward()
    return torch.cat([p.grad.reshape(-1) for _, p in trainable(model)])
