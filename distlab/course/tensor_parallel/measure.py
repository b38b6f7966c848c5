"""Chapter 7's measurements: the harness around the lecture's own parallel code, and one-process references.

The distributed code the chapter teaches lives in the lecture and comes in as arguments: the
`parallelize_module` plan of a block (`plan`), `parallelize(model, tp_mesh, sp=False)` that applies it to
every block, the sequence-parallel slice of a batch (`my_tokens(x, tp_mesh)`), and the 2-D composition
(`compose(model) -> (model, mesh)` with "dp" and "tp" axes). Each function here runs inside `distlab.launch`
on the chapter's model (`distlab.course.tensor_parallel.model`), builds the model, runs the meters and
returns raw measurements; the notebook compares them with the closed forms of
`distlab.theory.tensor_parallel` and writes the records:

    run = distlab.launch(tp_model_run, 4, args=(parallelize, "tp-medium", 8, 5, 15, 30))[0]   # the lecture's TP
    ref = distlab.launch(one_process_losses, 1, args=("tp-medium", 8, 5))[0]     # the same, one process

Meters: memory from `track_memory` (bytes autograd keeps, exact on CPU ranks), traffic from
`track_comm` (algorithmic bytes each rank sends, per collective), per process group from
`track_comm_by_group`, times from `distlab.bench.race` (barrier and device sync around every
call, the slowest rank's time). Every tensor a rank makes is placed on `rt.device()`, except in the
one-process references, which run on the CPU. Section 5 (context parallelism) is measured by
`distlab.course.tensor_parallel.measure_cp`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from distlab.bench.race import race
from distlab.course.models import lm_loss, synthetic_batch
from distlab.course.tensor_parallel.model import (TP_PRESETS, TPConfig, build_stack, build_tp_model,
                                                  track_comm_by_group)
from distlab.engine import runtime as rt
from distlab.meters import model_state, track_comm, track_memory


# ---- section 2: tensor parallelism with PyTorch's parallel styles --------------------------------------

def tp_parts(plan: Callable[[], dict[str, Any]], batch: int, preset: str = "tp-small") -> dict[str, dict[str, Any]]:
    """One block under the lecture's `plan()` (a `parallelize_module` plan) on every rank, attention and MLP apart.

    For each part: the collectives of forward (`fwd`) and of backward (`bwd`) as `CommStats`
    (what crosses the wire: one all-reduce of B x S x h each), and the largest difference of the
    output (`dy`) and of the input gradient (`dx`) from the unsharded block on the same input.
    """
    from torch.distributed.tensor.parallel import parallelize_module
    cfg, dev = TP_PRESETS[preset], rt.device()
    ref = build_tp_model(cfg, seed=1).blocks[0]
    blk = build_tp_model(cfg, seed=1).blocks[0]
    parallelize_module(blk, rt.mesh(), plan())
    out = {}
    for part in ("attn", "mlp"):
        x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(2)).to(dev)
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        with track_comm() as fwd:
            y = getattr(blk, part)(xt)
        with track_comm() as bwd:
            y.sum().backward()
        want = getattr(ref, part)(xr)
        want.sum().backward()
        out[part] = dict(fwd=fwd.stats(), bwd=bwd.stats(), dy=(y - want).abs().max().item(),
                         dx=(xt.grad - xr.grad).abs().max().item())
    return out


def colwise_gathered(style: Any, batch: int, preset: str = "tp-small") -> dict[str, Any]:
    """The MLP's first linear (h -> 4h) alone under the lecture's parallel `style`, there
    `ColwiseParallel(output_layouts=Replicate())`: column-parallel with its output gathered back to every rank,
    a column-parallel layer *not* followed by a row-parallel one, as a vocabulary-parallel head whose logits
    are wanted whole.

    Returns the forward and backward `CommStats` (what crosses the wire: an all-gather of the B x S x 4h output
    forward, the all-reduce of the input gradient backward) and the largest differences of the output (`dy`) and
    of the input gradient (`dx`) from the unsharded layer.
    """
    from torch.distributed.tensor.parallel import parallelize_module
    cfg, dev = TP_PRESETS[preset], rt.device()
    ref = build_tp_model(cfg, seed=1).blocks[0].mlp.fc
    fc = parallelize_module(build_tp_model(cfg, seed=1).blocks[0].mlp.fc, rt.mesh(), style)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(2)).to(dev)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    with track_comm() as fwd:
        y = fc(xt)
    with track_comm() as bwd:
        y.sum().backward()
    want = ref(xr)
    want.sum().backward()
    return dict(fwd=fwd.stats(), bwd=bwd.stats(), out_numel=y.numel(), dy=(y - want).abs().max().item(),
                dx=(xt.grad - xr.grad).abs().max().item())


def tp_model_run(parallelize: Callable[..., Any], preset: str, batch: int, steps: int, repeats: int,
                 budget_s: float) -> dict[str, Any]:
    """The lecture's `parallelize(model, tp_mesh)` on model `preset`: activations, a few training steps, a race.

    Returns `act`: bytes the blocks alone keep for backward (`build_stack`, same plan);
    `peak`: peak bytes of the last training step, the model's construction counted (SGD with
    momentum); `state`: the `ModelState` after the last step; `comm`: that step's `CommStats`
    (the TP all-reduces of activations, 4 per block, forward and backward); `losses` per step;
    `seconds`: median seconds of one training step (`race`, `repeats` at most, `budget_s` cap).
    """
    cfg, dev = TP_PRESETS[preset], rt.device()
    stack = parallelize(build_stack(preset, seed=1), rt.mesh())
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, device=dev, requires_grad=True)
    stack(x).sum().backward()       # warm-up: what a first call makes once (and keeps) is not an activation
    with track_memory() as mem:
        y = stack(x)
        act = mem.current_bytes
        y.sum().backward()
    with track_memory() as mem:                         # built inside: the weights count in the peak
        model = parallelize(build_tp_model(preset, seed=0), rt.mesh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(steps):
            xb, yb = synthetic_batch(step, batch, cfg)
            if step == steps - 1:
                mem.reset_peak()
            with track_comm() as comm:
                loss = lm_loss(model, xb, yb)
                loss.backward()
            opt.step()
            state = model_state(model, optimizer=opt)
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    xb, yb = synthetic_batch(0, batch, cfg)

    def step() -> None:
        lm_loss(model, xb, yb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    timing = race({"tp_torch": step}, repeats=repeats, budget_s=budget_s)
    return dict(act=act, peak=mem.peak_bytes, state=state, comm=comm.stats(), losses=losses,
                seconds=timing.median("tp_torch"))


def one_process_losses(preset: str, batch: int, steps: int, adam: bool = False) -> list[float]:
    """The reference: model `preset` trained in one process on the whole batch, on the CPU (nothing crosses
    a wire). SGD with momentum as `tp_model_run`, or AdamW (`adam`) as `two_d`; the loss of each step."""
    cfg = TP_PRESETS[preset]
    model = build_tp_model(preset, seed=0, device="cpu")
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adam
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for step in range(steps):
        xb, yb = synthetic_batch(step, batch, cfg, device="cpu")
        loss = lm_loss(model, xb, yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# ---- section 3: ZeRO-3 or TP on the same block ------------------------------------------------------------

def zero3_vs_tp(parallelize: Callable[..., Any], rows_per_rank: Sequence[int],
                preset: str = "tp-small") -> list[dict[str, int]]:
    """One block of `preset`, forward and backward, under ZeRO-3 (`fully_shard`, each rank its rows) and
    under TP (the lecture's `parallelize`, every rank all the rows), for each number of rows per rank.

    Per point: `tokens` in the global batch, and the bytes this rank sent for each: ZeRO-3 moves the
    block's weights and gradients (all-gathers, a reduce-scatter), TP the activations (all-reduces).
    """
    from torch.distributed.fsdp import fully_shard
    n, dev, cfg = rt.world_size(), rt.device(), TP_PRESETS[preset]
    z3 = build_stack(cfg, seed=0, n_layers=1)
    fully_shard(z3.blocks[0], mesh=rt.mesh())
    fully_shard(z3, mesh=rt.mesh())
    tp = parallelize(build_stack(cfg, seed=0, n_layers=1), rt.mesh())
    out = []
    for rows in rows_per_rank:
        x = torch.randn(n * rows, cfg.seq_len, cfg.d_model, device=dev)
        mine = x.chunk(n, 0)[rt.rank()]
        with track_comm() as zc:
            z3(mine).sum().backward()
        with track_comm() as tc:
            tp(x).sum().backward()
        out.append(dict(tokens=n * rows * cfg.seq_len, zero3=zc.stats().total_bytes, tp=tc.stats().total_bytes))
    return out


# ---- section 4: sequence parallelism ----------------------------------------------------------------------

def sp_run(parallelize: Callable[..., Any], my_tokens: Callable[..., torch.Tensor], preset: str, batch: int,
           steps: int, repeats: int, budget_s: float) -> dict[str, Any]:
    """The lecture's SP plan (`parallelize(model, tp_mesh, sp=True)`) on a stack of `preset` blocks, each rank
    its slice of the sequence (`my_tokens(x, tp_mesh)`, the lecture's too).

    Returns `acts`: bytes kept for backward without SP (key False) and with it (True); `comm`: the
    last training step's forward + backward traffic (all-gathers and reduce-scatters along the
    sequence); `opt_comm`: its optimizer step's (the all-reduce of the replicated LayerNorm
    gradients, left `Partial`); `params`: every parameter after `steps` SGD steps on a regression
    loss, whole (`full_tensor`); `data`: the (input, target) batches, for `sp_reference`;
    `seconds`: median seconds of forward + backward (`race`).
    """
    cfg, dev, mesh = TP_PRESETS[preset], rt.device(), rt.mesh()
    acts = {}
    for sp in (False, True):
        stack = parallelize(build_stack(preset, seed=1), mesh, sp=sp)
        x = torch.randn(batch, cfg.seq_len, cfg.d_model, device=dev)
        x = (my_tokens(x, mesh) if sp else x).contiguous().requires_grad_()
        with track_memory() as mem:
            y = stack(x)
            acts[sp] = mem.current_bytes
            y.sum().backward()
    model = parallelize(build_stack(preset, seed=0), mesh, sp=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g),
             torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g)) for _ in range(steps)]
    for step, (x, target) in enumerate(data):
        x, target = (my_tokens(z.to(dev), mesh).contiguous() for z in (x, target))
        with track_comm() as comm:
            loss = ((model(x) - target) ** 2).sum() / (batch * cfg.seq_len * cfg.d_model)
            loss.backward()
        with track_comm() as opt_comm:
            opt.step()
        opt.zero_grad(set_to_none=True)
    full = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for k, p in model.named_parameters()}
    x0 = my_tokens(data[0][0].to(dev), mesh).contiguous()

    def step() -> None:
        model(x0).sum().backward()
        opt.zero_grad(set_to_none=True)

    timing = race({"sp": step}, repeats=repeats, budget_s=budget_s)
    return dict(acts=acts, comm=comm.stats(), opt_comm=opt_comm.stats(), params=full, data=data,
                seconds=timing.median("sp"))


def sp_reference(data: Sequence[tuple[torch.Tensor, torch.Tensor]], preset: str = "tp-small") -> dict[str, torch.Tensor]:
    """`sp_run`'s training in one process on the whole sequence, on the CPU: the parameters after the steps."""
    ref = build_stack(preset, seed=0, device="cpu")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dev = next(ref.parameters()).device                 # the batches came as launch() arguments: move them there
    for x, target in data:
        x, target = x.to(dev), target.to(dev)
        ((ref(x) - target) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: p.detach() for k, p in ref.named_parameters()}


# ---- section 6: FSDP2 x TP on a 2 x 2 mesh -------------------------------------------------------------------

def two_d(compose: Callable[[Any], tuple[Any, Any]], preset: str, batch: int, steps: int) -> dict[str, Any]:
    """Model `preset` on 4 ranks, composed by the lecture's `compose(model) -> (model, mesh)` on a ("dp", "tp")
    mesh; each DP group trains on its share of the batch (AdamW), the ranks of a TP group on the same rows.

    Returns `state` (`ModelState` after the last step), `by_group`: the last step's bytes per process
    group and collective (TP groups: all-reduces of activations; DP groups: FSDP2's all-gathers and
    reduce-scatters of weights), `groups`: this rank's "dp" and "tp" groups, `losses` per step.
    """
    cfg = TP_PRESETS[preset]
    model, mesh = compose(build_tp_model(preset, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp, dp_rank, losses = mesh["dp"].size(), mesh["dp"].get_local_rank(), []
    for step in range(steps):
        xb, yb = synthetic_batch(step, batch, cfg)
        xb, yb = xb.chunk(dp, 0)[dp_rank], yb.chunk(dp, 0)[dp_rank]     # this DP group's rows of the batch
        with track_comm_by_group() as comm:
            loss = lm_loss(model, xb, yb)
            loss.backward()
        opt.step()
        state = model_state(model, optimizer=opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    groups = {"dp": tuple(mesh["dp"].mesh.tolist()), "tp": tuple(mesh["tp"].mesh.tolist())}
    return dict(state=state, by_group=comm.stats(), groups=groups, losses=losses)
