"""Strategy `pp`: the course GPT cut into one pipeline stage per rank, run by `torch.distributed.pipelining`.

    pipe, opt, _ = wrap("pp", model, lr=3e-3, microbatches=4)     # on every rank (strategies.wrap)
    loss = pipeline_step(pipe, opt, None, x, y, 4)                 # this rank's share of the logged loss

The split is chapter 8's (`distlab.course.pipeline.stages.Stage`): rank r of p runs blocks [a, b) of the
model (`stage_layers`), the embeddings on rank 0, the final norm and the head on rank p - 1, sharing the
built model's parameters. PyTorch's `PipelineStage` wraps that stage, and `Schedule1F1B` runs the loop's
gradient-accumulation micro-batches through it: m = `accumulate` micro-batches of B/m rows per step,
warm-up forwards, then one forward and one backward in turn. What crosses the wire is PyTorch's: per
micro-batch and stage boundary one (B/m, T, d) activation forward and its gradient back, each a
point-to-point message. In 1F1B's steady phase the schedule fires a forward send together with the
backward receive it will wait for, in one `batch_isend_irecv` (what lets NCCL progress both sides);
warm-up and cool-down sends and receives go out alone, asynchronously (torch 2.13's `_batch_p2p`). No
gradient is reduced: each rank owns its stage.

Every rank reads the whole global batch (stage 0 needs the tokens, the last stage the targets); the loss
exists only on the last stage, which `pipeline_loss` broadcasts to every rank (one fp32 scalar from rank
p - 1), so every rank logs the same global loss.

For checkpoints `Pipeline.named` holds this stage's parameters under their names in the whole model
(`blocks.3.fc.weight` on the rank that holds block 3): with the optimizer's state flattened per parameter,
DCP's keys are the whole model's, whatever the split, so a pp checkpoint resumes at another world size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.course.pipeline.stages import Stage, stage_loss


@dataclass
class Pipeline:
    """This rank's part of a pipeline: the course `Stage`, PyTorch's schedule over it, and `named` (the
    stage's parameters under the whole model's names, for checkpoints)."""

    stage: Stage
    schedule: Any
    named: nn.Module
    microbatches: int

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.stage.parameters()


def whole_model_names(stage: Stage) -> nn.Module:
    """A module holding `stage`'s own parameters (no copy) at the paths they have in the whole GPT."""
    named = nn.Module()
    if stage.is_first:
        named.tok, named.pos = stage.tok, stage.pos
    named.blocks = nn.ModuleDict({str(stage.first_block + i): b for i, b in enumerate(stage.blocks)})
    if stage.is_last:
        named.ln_f, named.head = stage.ln_f, stage.head
    return named


def pipeline_parallel(model: nn.Module, microbatches: int) -> Pipeline:
    """Rank r of p's stage of `model` in a 1F1B pipeline of m = `microbatches` (on `distlab.device()`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from distlab.engine import runtime as rt
    r, p = rt.rank(), rt.world_size()
    stage = Stage(model, r, p)                                     # blocks [a, b); embeddings first, head last
    pstage = PipelineStage(stage, r, p, rt.device())               # knows its neighbours r - 1 and r + 1
    schedule = Schedule1F1B(pstage, n_microbatches=microbatches, loss_fn=stage_loss)   # grads scaled by 1/m
    _keep_only(model, stage)
    return Pipeline(stage, schedule, whole_model_names(stage), microbatches)


def _keep_only(model: nn.Module, stage: Stage) -> None:
    """Free, in `model`, what other stages run: each rank then holds its 1/p of the layers (every rank built the
    whole model from one seed, so the stages start from one process's weights). In place, as `fully_shard`
    shards a model in place; the whole model's forward is gone on this rank."""
    own = range(stage.first_block, stage.first_block + len(stage.blocks))
    for i in range(len(model.blocks)):
        if i not in own:
            model.blocks[i] = nn.Identity()
    for name, kept in (("tok", stage.is_first), ("pos", stage.is_first), ("ln_f", stage.is_last), ("head", stage.is_last)):
        if not kept:
            setattr(model, name, None)


def pipeline_step(pipe: Pipeline, opt: Any, sync_grads: Any, x: torch.Tensor, y: torch.Tensor, accumulate: int
                  ) -> torch.Tensor:
    """One step: the schedule runs m micro-batches forward and backward (stage 0 is fed the tokens, the last
    stage the targets), then each rank's optimizer updates its own stage. Returns the mean of the m
    micro-batch losses on the last stage, 0 elsewhere (`pipeline_loss` makes it every rank's)."""
    losses: list[torch.Tensor] = []
    stage = pipe.stage
    pipe.schedule.step(*((x,) if stage.is_first else ()),
                       **({"target": y, "losses": losses} if stage.is_last else {}))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack(losses).detach().mean() if losses else torch.zeros((), device=x.device)


def pipeline_eval(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss of one batch, forward only (the schedule's `eval`), on the last stage; 0 elsewhere."""
    losses: list[torch.Tensor] = []
    stage = pipe.stage
    with torch.no_grad():
        pipe.schedule.eval(*((x,) if stage.is_first else ()),
                           **({"target": y, "losses": losses} if stage.is_last else {}))
    return torch.stack(losses).detach().mean() if losses else torch.zeros((), device=x.device)


def pipeline_loss(value: torch.Tensor) -> float:
    """The last stage's loss on every rank: one fp32 scalar broadcast from rank p - 1."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().float().clone()
        dist.broadcast(value, src=dist.get_world_size() - 1)
    return float(value)
