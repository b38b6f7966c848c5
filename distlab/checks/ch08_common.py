"""What lab 8's tasks share: the model's size, the hang hints, a batch, and the drawn inputs of stages
(grading only: each stage gets its own weights, the first stage the tokens, the last the targets)."""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_weights, load_weights

PRESET, SEED, LAYERS, MICRO = "tiny", 0, 4, 2      # 4 blocks: up to 4 stages; 2 rows per micro-batch
OFFLOAD_LR, OFFLOAD_WD, OFFLOAD_STEPS, OFFLOAD_BATCH = 5e-2, 0.1, 3, 8

PIPE_HINT = ("A pipeline hangs when a rank waits for a message its neighbour never sends: every recv "
             "needs a send of the same shape, in the same order, on the neighbour.")
# Only where a schedule interleaves forwards and backwards (1F1B) does the order of a send and a receive matter.
PIPE_1F1B_HINT = (PIPE_HINT + " In 1F1B, post the send of a forward's output together with the receive of the "
                  "next gradient (dist.batch_isend_irecv).")


def _batch(m: int, config: Any, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    from distlab.course.models import synthetic_batch
    return synthetic_batch(0, MICRO * m, config, device=device)


# ---- drawn inputs (grading only): a stage gets its own weights, the first stage the tokens, the last the targets

def _drawn_stages(rng: torch.Generator, stages: int, rows: int, n_layers: int) -> tuple[list, torch.Tensor,
                                                                                      torch.Tensor]:
    """(each stage's weights under "w.", the tokens, the targets) of a model and a batch from drawn seeds."""
    from distlab.course.models import build_model, synthetic_batch
    from distlab.course.pipeline.stages import Stage
    model = build_model(PRESET, seed=draw_seed(rng), n_layers=n_layers, device="cpu")
    x, y = synthetic_batch(0, rows, model.config, seed=draw_seed(rng), device="cpu")
    return [drawn_weights(Stage(model, s, stages), "w.") for s in range(stages)], x, y


def _model_of_stages(weights: list[dict[str, torch.Tensor]], n_layers: int) -> torch.nn.Module:
    """In the grader: the whole model with each stage's drawn weights (`weights[s]`: stage s's inputs)."""
    from distlab.course.models import build_model
    from distlab.course.pipeline.stages import Stage
    model = build_model(PRESET, seed=SEED, n_layers=n_layers, device="cpu")
    for s, mine in enumerate(weights):
        load_weights(Stage(model, s, len(weights)), mine, "w.")
    return model


def _stage_batch(inputs: dict[str, torch.Tensor], rows: int, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """On a rank: its drawn tokens and targets where it has them; elsewhere zeros of their shape (only
    their shape is read: `activation_bytes` on a middle stage; the learner gets None for them)."""
    dev = distlab.device()
    blank = torch.zeros(rows, config.seq_len, dtype=torch.long)
    return inputs.get("x", blank).to(dev), inputs.get("y", blank).to(dev)
