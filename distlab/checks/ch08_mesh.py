"""Lab 8's 3-D task: one training step of a 2 x 2 x 2 (pp, dp, tp) mesh on 8 ranks. `ch08` lists it."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.draws import load_weights
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import CheckFailed, compare, expect

from distlab.checks.ch08_common import MICRO, PRESET, SEED, _batch, _drawn_stages, _model_of_stages, _stage_batch


# ---- a 2 x 2 x 2 step: pp x dp x tp on one mesh ---------------------------------------------------------------

MESH_SHAPE, MESH_M, MESH_LAYERS = (2, 2, 2), 2, 2     # (pp, dp, tp); 2 micro-batches; one block per stage

MESH_HINT = ("In the mesh, a stage's pipeline neighbours are the ranks before and after it in its pp group "
             "(dist.get_process_group_ranks(groups['pp'])), not rank r - 1 and r + 1: with tp innermost, "
             "rank r + 1 is your tp partner. Every recv needs a send of the same shape on that neighbour.")


# ---- step_3d ----------------------------------------------------------------------------------------
# `step_3d(stage, groups, x, y, m, micro_batch)` on 8 ranks, a (pp, dp, tp) = 2 x 2 x 2 mesh in the
# course's order (`distlab.course.pipeline.mesh3d.MESH_ORDER`). Each rank gets its stage of the 2-block
# "tiny" model (fp32) with its blocks cut over its tp group (`tp_stage`: Megatron's f and g inside),
# its groups, and its dp replica's m micro-batches (tokens on the first stage, targets on the last).
# The learner runs the pipeline between the stage's pp neighbours and averages the gradients over dp.
#
# Lines: values (the last stage's loss, the replica's mean, and every rank's gradient, its tp slice,
# equal one process's on the whole global batch); pp (send/recv only between pipeline neighbours: one
# activation per micro-batch and link, exactly its bytes); dp (the gradients' average: 2(dp - 1)/dp of
# the stage's gradient bytes in the dp group, all-reduce or reduce-scatter + all-gather, no other group);
# tp (the stage's own f and g: 4 all-reduces per block and micro-batch in the tp group, exactly).

def step_3d_cases() -> list[Case]:
    pp, dp, tp = MESH_SHAPE
    head = f"step_3d, (pp, dp, tp) = ({pp}, {dp}, {tp}), m={MESH_M}"
    return [Case(pp * dp * tp, tuple(f"{head}, {k}" for k in ("values", "pp", "dp", "tp")),
                 {"shape": MESH_SHAPE, "m": MESH_M})]


def step_3d_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank its stage's weights (whole: `tp_stage` cuts them); a first-stage rank its dp
    replica's tokens, a last-stage rank its replica's targets. Ranks in `distlab.mesh`'s row-major order."""
    pp, dp, tp = case.args["shape"]
    rows = case.args["m"] * MICRO
    weights, x, y = _drawn_stages(rng, pp, dp * rows, MESH_LAYERS)
    out = []
    for r in range(pp * dp * tp):
        s, d = r // (dp * tp), r // tp % dp
        mine = dict(weights[s])
        if s == 0:
            mine["x"] = x[d * rows:(d + 1) * rows]
        if s == pp - 1:
            mine["y"] = y[d * rows:(d + 1) * rows]
        out.append(mine)
    return out


def step_3d_exercise(case: Case, fn: Any, inputs: dict | None = None) -> dict:
    from distlab.course.pipeline.mesh3d import MESH_ORDER, tp_stage
    from distlab.course.pipeline.stages import build_stage
    from distlab.course.tensor_parallel.model import track_comm_by_group
    pp, dp, tp = case.args["shape"]
    m = case.args["m"]
    mesh = distlab.mesh(pp, dp, tp, names=MESH_ORDER)
    coord = dict(zip(MESH_ORDER, mesh.get_coordinate()))
    groups = {n: mesh.get_group(n) for n in MESH_ORDER}
    ranks = {n: tuple(dist.get_process_group_ranks(g)) for n, g in groups.items()}
    s = coord["pp"]
    whole = build_stage(PRESET, s, pp, seed=SEED, n_layers=MESH_LAYERS)
    if inputs is None:
        x, y = _batch(dp * m, whole.config)
        rows = slice(coord["dp"] * m * MICRO, (coord["dp"] + 1) * m * MICRO)
        x, y = x[rows], y[rows]
    else:
        load_weights(whole, inputs, "w.")
        x, y = _stage_batch(inputs, m * MICRO, whole.config)
    stage = tp_stage(whole, groups["tp"])
    distlab.engine.runtime.progress(f"step_3d on {pp} x {dp} x {tp}: stage {s}")
    with track_comm_by_group() as meter:
        loss = fn(stage, groups, x if s == 0 else None, y if s == pp - 1 else None, m, MICRO)
    label = {r: n for n, r in ranks.items()}
    comm = {label.get(g, "ranks " + ", ".join(map(str, g))): dict(v) for g, v in meter.stats().items()}
    calls = {label.get(g, "ranks " + ", ".join(map(str, g))): dict(v) for g, v in meter.calls_by_group.items()}
    if isinstance(loss, torch.Tensor):
        loss = loss.detach().float().cpu().reshape(-1)[0].item() if loss.numel() else None
    grads = {name: [full, dim, blocks, q.grad.detach().float().cpu().clone() if q.grad is not None else None]
             for (name, q), (full, dim, blocks) in
             ((nq, stage.cuts[nq[0]]) for nq in stage.named_parameters())}
    return {"coord": coord, "ranks": {n: list(r) for n, r in ranks.items()}, "loss": loss, "grads": grads,
            "comm": comm, "calls": calls, "d_model": stage.config.d_model, "seq_len": stage.config.seq_len,
            "blocks": len(stage.blocks)}


def step_3d_reference(case: Case, inputs: list | None = None) -> dict:
    from distlab.course.models import build_model, lm_loss
    pp, dp, tp = case.args["shape"]
    m = case.args["m"]
    if inputs is None:
        model = build_model(PRESET, seed=SEED, n_layers=MESH_LAYERS, device="cpu")
        x, y = _batch(dp * m, model.config, device="cpu")
    else:             # stage s's weights from its first rank; the replicas' rows in dp order
        model = _model_of_stages([inputs[s * dp * tp] for s in range(pp)], MESH_LAYERS)
        x = torch.cat([inputs[d * tp]["x"] for d in range(dp)])
        y = torch.cat([inputs[(pp - 1) * dp * tp + d * tp]["y"] for d in range(dp)])
    lm_loss(model, x, y).backward()
    with torch.no_grad():
        replica = [lm_loss(model, x[d * m * MICRO:(d + 1) * m * MICRO], y[d * m * MICRO:(d + 1) * m * MICRO]).item()
                   for d in range(dp)]
    return {"grads": {n: q.grad.clone() for n, q in model.named_parameters()}, "replica_loss": replica}


def step_3d_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    from distlab.course.pipeline.mesh3d import cut
    pp, dp, tp = case.args["shape"]
    m = case.args["m"]

    def values() -> str:
        for r, o in enumerate(outputs):
            s, d, t = o["coord"]["pp"], o["coord"]["dp"], o["coord"]["tp"]
            if s == pp - 1:
                expect(o["loss"] is not None, f"rank {r} (last stage) returned None: it must return the mean "
                       "loss of its dp replica's rows")
                compare(torch.tensor(float(o["loss"])), torch.tensor(reference["replica_loss"][d]),
                        atol=1e-5, rtol=1e-4, what=f"rank {r}'s loss (dp replica {d})")
            for name, (full, dim, blocks, g) in o["grads"].items():
                want = reference["grads"][full]
                if dim is not None:
                    want = cut(want, t, tp, dim, blocks)
                expect(g is not None and bool(g.abs().sum() > 0),
                       f"rank {r}: {name} has no gradient: run the backward of every micro-batch")
                try:
                    compare(g, want, atol=1e-5, rtol=1e-4, what=f"rank {r}'s gradient of {name} ({full}"
                            + (f", tp slice {t}" if dim is not None else "") + ")")
                except CheckFailed as exc:
                    raise CheckFailed(f"{exc}; the gradient must be the mean over the dp replicas (all-reduce "
                                      "in the dp group, divided by its size) of each replica's mean over its "
                                      "micro-batches (each loss scaled by 1/m)") from None
        return "every rank's loss and gradient (its tp slice) equal one process's on the global batch"

    def pp_line() -> str:
        for r, o in enumerate(outputs):
            s = o["coord"]["pp"]
            act = MICRO * o["seq_len"] * o["d_model"] * 4
            sends = sum(c.get("send", 0) for c in o["calls"].values())
            recvs = sum(c.get("recv", 0) for c in o["calls"].values())
            sent = sum(c.get("send", 0) for c in o["comm"].values())
            links = (s > 0) + (s < pp - 1)
            expect(sends == m * links and recvs == m * links,
                   f"rank {r} (stage {s}) posted {sends} sends and {recvs} receives; expected {m * links} of "
                   "each (one activation forward, one gradient back per micro-batch and link)")
            expect(sent == m * links * act, f"rank {r} sent {sent} bytes point to point; expected "
                   f"{m * links * act} (one activation of {act} bytes per message)")
        return "one activation per micro-batch and direction between pipeline neighbours"

    def dp_line() -> str:
        for r, o in enumerate(outputs):
            extra = sorted(g for g, c in o["comm"].items()
                           if g not in ("dp", "tp") and any(k not in ("send", "recv") for k in c))
            if extra:
                raise CheckFailed(f"rank {r} ran a collective in the group of {extra[0]}: average the gradients "
                                  "in the dp group only (a tp group holds different slices, the other stages "
                                  "different layers)")
            grad_bytes = sum(g.numel() * 4 for _, _, _, g in o["grads"].values() if g is not None)
            want = 2 * grad_bytes * (dp - 1) / dp
            got = sum(o["comm"].get("dp", {}).values())
            expect(want <= got <= want * 1.01 + 64,
                   f"rank {r} sent {got} bytes in its dp group; averaging its {grad_bytes} bytes of gradients "
                   f"moves 2(dp - 1)/dp of them: {want:.0f} (one all-reduce, or a reduce-scatter and an "
                   "all-gather)")
        return "the gradients averaged in the dp group: 2(dp - 1)/dp of their bytes, no other group"

    def tp_line() -> str:
        for r, o in enumerate(outputs):
            act = MICRO * o["seq_len"] * o["d_model"] * 4
            want = m * 4 * o["blocks"] * act * 2 * (tp - 1) // tp
            got = o["comm"].get("tp", {})
            expect(set(got) <= {"all_reduce"} and got.get("all_reduce", 0) == want,
                   f"rank {r} sent {sum(got.values())} bytes in its tp group ({', '.join(sorted(got)) or 'none'}); "
                   f"the stage's f and g move {want}: 4 all-reduces per block per micro-batch, forward and "
                   "backward once each (no collective of your own in tp)")
        return "the blocks' f and g: 4 all-reduces per block and micro-batch in the tp group"

    fns = {"values": values, "pp": pp_line, "dp": dp_line, "tp": tp_line}
    return [check_line(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]
