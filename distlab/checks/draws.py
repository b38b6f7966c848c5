"""What a task's `inputs` draws under grading (never in the notebook): starting weights and batches, as
tensors. The seeds stay in the grader; each rank receives only its own tensors."""
from __future__ import annotations

import torch


def draw_seed(rng: torch.Generator) -> int:
    """A seed drawn from `rng`, for the package's seeded builders; it stays in the grader (ranks get tensors).
    Below 2**40: `synthetic_batch` multiplies its seed by about 1e6 into a 64-bit one."""
    return int(torch.randint(0, 2**40, (1,), generator=rng))


def drawn_weights(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A (freshly built, drawn-seed) model's parameters as one rank's inputs, named `prefix` + parameter name."""
    return {f"{prefix}{k}": v.detach().cpu().clone() for k, v in model.named_parameters()}


def load_weights(model: torch.nn.Module, inputs: dict[str, torch.Tensor], prefix: str) -> torch.nn.Module:
    """On the rank: `model`'s parameters overwritten, in place, by its drawn ones (see `drawn_weights`)."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(inputs[prefix + k])
    return model


def weights_of(inputs: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The parameters `drawn_weights` put in one rank's inputs under `prefix`, by parameter name."""
    return {k.removeprefix(prefix): v for k, v in inputs.items() if k.startswith(prefix)}


def drawn_batch_shards(rng: torch.Generator, world_size: int, steps: int, batch_size: int,
                       preset: str = "tiny") -> list[dict[str, torch.Tensor]]:
    """`steps` batches of the package's kind from a drawn seed, each rank's shard only: rank r gets
    `x{step}`, `y{step}` (its `split_batch` slice)."""
    from distlab.course.models import PRESETS, split_batch, synthetic_batch
    seed, out = draw_seed(rng), [{} for _ in range(world_size)]
    for step in range(steps):
        full = synthetic_batch(step, batch_size, PRESETS[preset], seed=seed, device="cpu")
        for r in range(world_size):
            out[r][f"x{step}"], out[r][f"y{step}"] = split_batch(full, r, world_size)
    return out


def full_batches(inputs: list[dict[str, torch.Tensor]], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """In the grader: each step's whole batch, the ranks' shards put back together in rank order."""
    return [(torch.cat([i[f"x{s}"] for i in inputs]), torch.cat([i[f"y{s}"] for i in inputs]))
            for s in range(steps)]
