"""Chapter 8's planner checked against simulation: the model states one device holds, predicted and simulated.

    checks = check_recipes({"ZeRO2": ZeRO2})       # 7B, 13B, 70B, 175B on their GPU counts
    [round(c.ratio, 4) for c in checks]            # simulated / predicted
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distlab.course.models import GPTConfig
from distlab.course.sim.run import simulate
from distlab.course.sim.step import LR
from distlab.course.sim.world import compute_like_a_gpu, fake_world
from distlab.engine.precision import MixedPrecisionAdam
from distlab.meters import ModelState, model_state

# ---- the chapter-8 planner, checked against simulation ----------------------------------------------------

class _FirstStage(nn.Module):
    """Pipeline stage 0 of chapter 7's transformer as one device holds it: the embeddings, blocks [0, b),
    and the final norm and head when there is one stage."""

    def __init__(self, c: Any, layers: int, last: bool, positions: bool) -> None:
        from distlab.course.tensor_parallel.model import Block
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model) if positions else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c.d_model) if last else None
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False) if last else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from distlab.course.tensor_parallel.model import run_blocks
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = run_blocks(self.blocks, x, "none")
        return self.head(self.ln_f(x)) if self.head is not None else x   # (B, S, V), or (B, S, h) to stage 1


def _tp_pp_zero3_states(spec: Any, layout: Any, seq_len: int, backward: bool = True) -> ModelState:
    """Rank 0 (pipeline stage 0) of a dp x tp x pp layout with ZeRO-3 over dp (FSDP2, as torchtitan composes
    it): chapter 7's transformer in bf16, its blocks tensor-parallel (`parallelize_blocks`, PyTorch's
    parallel styles, embeddings and head replicated), `fully_shard` per block and root on the dp mesh,
    `MixedPrecisionAdam`; one forward, backward and step; the model states at its end. `backward=False`
    gives every (sharded) parameter a zero gradient of its own shape and creates the optimizer states its
    first step would (fp32 master, m, v) without running forward, backward or the update: the same model
    states, for a fraction of the ops (no traffic is issued)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from distlab.course.pipeline.stages import stage_layers
    from distlab.course.tensor_parallel.model import TPConfig, parallelize_blocks
    L = layout
    with unset_fake_temporarily():
        mesh = init_device_mesh("cpu", (L.pp, L.dp, L.tp), mesh_dim_names=("pp", "dp", "tp"))
    c = TPConfig(vocab_size=spec.vocab_size, seq_len=seq_len, d_model=spec.d_model, n_heads=spec.n_heads,
                 n_layers=spec.n_layers)
    a, b = stage_layers(spec.n_layers, L.pp)[0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        stage = _FirstStage(c, b - a, last=L.pp == 1, positions=spec.max_seq > 0)
    finally:
        torch.set_default_dtype(default)
    if L.tp > 1:
        parallelize_blocks(stage, mesh["tp"])
    if L.dp > 1:
        # With tp, FSDP2 joins the dp and tp meshes, which builds a mesh from real rank tensors: the fake
        # mode steps aside (the parameters stay fake: a fake tensor's ops run in its own fake mode).
        with unset_fake_temporarily():
            for block in stage.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
    opt = MixedPrecisionAdam(stage.parameters(), lr=LR)
    if backward:
        x = torch.randint(0, spec.vocab_size, (L.micro_batch, seq_len))
        stage(x).float().mean().backward()     # stage 0 of several: stands in for the gradient stage 1 sends back
        opt.step()
    else:   # what the first step leaves, without its arithmetic: a gradient and fp32 master, m, v per shard
        for p in stage.parameters():
            p.grad = torch.zeros_like(p)
            opt._state_for(p)
    return model_state(list(stage.parameters()), optimizer=opt)


@dataclass(frozen=True)
class PlanCheck:
    """The planner's model states per device (pipeline stage 0) against the same layout simulated."""

    name: str
    layout: str
    gpus: int
    num_params: int
    predicted_bytes: float
    simulated_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.simulated_bytes / self.predicted_bytes


def check_plan(spec: Any, layout: Any, *, seq_len: int = 4096, classes: dict[str, Any] | None = None,
               name: str = "", backward: bool = True, blocks: int | None = None) -> PlanCheck:
    """Simulate `layout` (a `distlab.course.planner.Layout`) for `spec` as rank 0 of its GPUs and compare the
    model states one device holds with `planner.plan`'s prediction for pipeline stage 0.

    ZeRO-3: FSDP2 over dp, with PyTorch's TP over tp and pipeline stage 0 of pp (as torchtitan composes
    them) on chapter 7's transformer; embeddings and head are replicated over tp, so the prediction is
    made with `vocab_parallel=False`. ZeRO-0/1/2 (dp only): the course GPT with DDP or the labs' classes
    (pass `classes`). `backward=False` skips the ZeRO-3 runs' forward and backward (zero gradients of
    each shard's shape instead: the same model states; see `_tp_pp_zero3_states`). Activations are not
    compared: the planner's Korthikanti model and the course models' saved tensors differ by design.

    `blocks=k` simulates a slice instead of the whole depth: the model with k, then k + 1 blocks on
    pipeline stage 0 (k pp and (k + 1) pp blocks in all), and extends the two linearly to the stage's
    B blocks, S(B) = S(k) + (B - k) (S(k + 1) - S(k)). Every block has the same shapes, so it adds the
    same states (to the padding of a flat ZeRO bucket: a few bytes); the embeddings, the head and the
    sharding are those of the full model.
    """
    from distlab.course.planner import Workload, plan
    L = layout
    start = time.perf_counter()
    predicted = plan(spec, L, Workload(seq_len=seq_len, global_batch=L.dp * L.micro_batch * L.m),
                     vocab_parallel=False).model_state_bytes[0]
    if L.cp != 1:
        raise ValueError("context parallelism is not simulated: use cp=1")
    if L.zero != 3 and (L.tp != 1 or L.pp != 1):
        raise ValueError(f"{L}: with tp or pp the simulation runs ZeRO-3 over dp (FSDP2) only; use zero=3")
    from distlab.course.pipeline.stages import stage_layers
    a, b = stage_layers(spec.n_layers, L.pp)[0]
    if blocks is None or b - a <= blocks + 1:
        simulated = _simulated_states(spec, L, seq_len, classes, backward)
    else:
        from dataclasses import replace as with_
        few, more = (_simulated_states(with_(spec, n_layers=k * L.pp), L, seq_len, classes, backward)
                     for k in (blocks, blocks + 1))
        simulated = few + (b - a - blocks) * (more - few)
    return PlanCheck(name or spec.name, str(L), L.gpus, spec.num_params, predicted, simulated,
                     time.perf_counter() - start)


def _simulated_states(spec: Any, L: Any, seq_len: int, classes: dict[str, Any] | None, backward: bool) -> int:
    """The model states (bytes) rank 0 of layout `L` holds, simulated for `spec` (see `check_plan`)."""
    if L.zero == 3:
        with compute_like_a_gpu(), fake_world(L.gpus):
            return _tp_pp_zero3_states(spec, L, seq_len, backward).total
    strategy = {0: "ddp", 1: "zero1", 2: "zero2"}[L.zero]
    config = GPTConfig(vocab_size=spec.vocab_size, seq_len=seq_len, d_model=spec.d_model,
                       n_layers=spec.n_layers, n_heads=spec.n_heads)
    # ZeRO-2 buckets of 500 MB (DeepSpeed's default reduce bucket is 5e8 elements): at this size the
    # course's 25 MB would make hundreds of buckets, and the model states do not depend on it.
    return simulate(strategy, config=config, world_size=L.dp, classes=classes, steps=1,
                    bucket_size_mb=500).model_state.total


def recipe_layouts() -> list[tuple[float, Any]]:
    """The source notes' recipes by model size, each on a GPU count it is used at: 7B data parallel with
    ZeRO-2 on 8 GPUs, 13B ZeRO-3 on 16, 70B ZeRO-3 + TP 8 on 64, 175B 3-D (dp 8 x tp 8 x pp 16) + ZeRO-3
    on 1024."""
    from distlab.course.planner import Layout
    return [(7e9, Layout(dp=8, zero=2)), (13e9, Layout(dp=16, zero=3)), (70e9, Layout(dp=8, tp=8, zero=3)),
            (175e9, Layout(dp=8, tp=8, pp=16, zero=3, m=16))]


def check_recipes(classes: dict[str, Any] | None = None, *, seq_len: int = 4096,
                  backward: bool = True, blocks: int | None = None) -> list[PlanCheck]:
    """`check_plan` for every recipe of `recipe_layouts` (the 7B one runs lab 4's ZeRO2: pass `classes`);
    `blocks=1`: each from a slice of 1 and 2 blocks per stage (see `check_plan`)."""
    from dataclasses import replace as with_
    from distlab.course.planner import ModelSpec
    out = []
    for size, layout in recipe_layouts():
        spec = with_(ModelSpec.from_size(size), max_seq=seq_len)    # learned positions, as the course models
        out.append(check_plan(spec, layout, seq_len=seq_len, classes=classes, name=f"{size / 1e9:g}B",
                              backward=backward, blocks=blocks))
    return out
