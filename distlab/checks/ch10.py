"""Lab 10's graded tasks: a router with capacity, the load-balancing loss, dispatch and combine with an uneven
all-to-all, and an expert-parallel MoE layer trained inside the course GPT.

Every task judges, from raw outputs, against one process computing the same thing here with chapter 10's
reference (`distlab.course.moe.layer`), and the traffic against `distlab.theory.moe`:

- router: which experts, which gates, which assignments are kept in which slot (first choices first, in token
  order), for top-1 and top-2, with and without a capacity;
- aux_loss: Switch's E x sum_e f_e P_e and its gradient with respect to the logits;
- dispatch_combine (2 and 4 ranks): the rows each rank receives (by source rank, then expert), the rows combine
  returns, the round trip's gradient; traffic: one all-to-all of counts and one uneven all-to-all forward in
  dispatch, one in combine, one each backward, exactly the formula's bytes, no other collective;
- ep_layer: the MoE GPT (8 experts, top-2, capacity factor 1.25) with every MoE layer the learner's expert-parallel
  one on 2 and 4 ranks (E/N experts and a slice of the batch each), 3 steps: losses and parameters against one
  process; each step's all-to-alls against the formula, from the reference's own routing.

Under `distlab grade` the logits, the counts and rows, the starting weights and the batches are drawn from a
secret seed; each rank receives only its own rows and its own slice of the batch.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.ch07_common import expect_traffic, make_optimizer, same, values_line
from distlab.checks.draws import draw_seed, drawn_weights, load_weights
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import expect
from distlab.course.data_parallel.reference import one_thread
from distlab.course.moe.layer import MoEConfig, build_moe_model, capacity, load_balancing_loss, moe_loss, route
from distlab.meters import track_comm
from distlab.theory import moe as th

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab.course.moe.layer import MoE, RouterStats, capacity, router_z_loss"""

E, H, E_BYTES = 8, 16, 4                       # experts, row width (dispatch task), fp32
D = 32                                         # the tiny GPT's h: the rows the EP layer sends
T = 24                                         # tokens the router and the loss see
ROUTES = ((1, 1.0), (2, 1.25), (2, None))      # (k, capacity factor) the router is checked with
CFG = MoEConfig(n_experts=8, k=2, capacity_factor=1.25)
ROWS, STEPS, AUX = 2, 3, 0.01                  # batch rows per rank, training steps, aux-loss weight
ATOL, RTOL = 2e-5, 1e-4
TRAIN_ATOL, TRAIN_RTOL = 1e-4, 1e-3
HANG_HINT = ("Ranks hang when one of them skips an all-to-all the others enter, or when the split sizes do not "
             "agree: what rank i sends to rank j (in_splits[j] on i) must be what j expects from i "
             "(out_splits[i] on j). Exchange the counts first.")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_thread(reference: Any) -> Any:
    """A reference on one intra-op thread: beside the ranks, two on two busy cores made it 25x slower (12.7 s)."""
    @functools.wraps(reference)
    def wrapped(case: Case, inputs: list | None = None) -> Any:
        with one_thread():
            return reference(case, inputs)
    return wrapped


# ---- the router and the loss (one rank) ------------------------------------------------------------------------

def router_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [{f"logits{i}": torch.randn(T, E, generator=rng) * 2 for i in range(len(ROUTES))}]


def _router_logits(inputs: dict | None) -> list[torch.Tensor]:
    if inputs is None:
        return [torch.randn(T, E, generator=_gen(10 + i)) * 2 for i in range(len(ROUTES))]
    return [inputs[f"logits{i}"] for i in range(len(ROUTES))]


def router_exercise(case: Case, route_fn: Any, inputs: dict | None = None) -> list:
    out = []
    for (k, cf), logits in zip(ROUTES, _router_logits(inputs)):
        expert, weight, slot = route_fn(logits.to(distlab.device()), k, capacity(T, k, E, cf))
        out.append({"expert": expert.cpu(), "weight": weight.detach().cpu(), "slot": slot.cpu()})
    return out


@_one_thread
def router_reference(case: Case, inputs: list | None = None) -> list:
    out = []
    for (k, cf), logits in zip(ROUTES, _router_logits(None if inputs is None else inputs[0])):
        expert, weight, slot = route(logits, k, capacity(T, k, E, cf))
        out.append({"expert": expert, "weight": weight, "slot": slot})
    return out


def router_judge(case: Case, outputs: list, ref: list) -> list[Line]:
    mine = outputs[0]

    def gates() -> str:
        for (k, cf), got, want in zip(ROUTES, mine, ref):
            same(got["expert"], want["expert"], f"top-{k} experts (best first)", 0, 0)
            same(got["weight"], want["weight"], f"top-{k} gates (renormalised over the {k})")
        return "the k best experts, best first, and their renormalised gates"

    def kept() -> str:
        for (k, cf), got, want in zip(ROUTES, mine, ref):
            where = f"top-{k}, " + (f"capacity factor {cf}" if cf else "no capacity")
            same(got["slot"], want["slot"], f"slots ({where}; -1 = dropped)", 0, 0)
        return "first choices before second ones, in token order; the rest dropped (-1)"

    return [check_line(case.lines[0], gates), check_line(case.lines[1], kept)]


def aux_loss_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [{"logits": torch.randn(T, E, generator=rng) * 2, "skewed": torch.randn(T, E, generator=rng) * 2}]


def _aux_loss_logits(inputs: dict | None) -> list[torch.Tensor]:
    if inputs is None:
        return [torch.randn(T, E, generator=_gen(20)) * 2, torch.randn(T, E, generator=_gen(21)) * 2]
    return [inputs["logits"], inputs["skewed"]]


def _aux_loss_cases(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    skewed = logits[1].clone()
    skewed[:, 0] += 3.0                      # most tokens prefer expert 0: a loss well above 1
    return [logits[0], skewed]


def aux_loss_exercise(case: Case, loss_fn: Any, inputs: dict | None = None) -> list:
    out = []
    for logits in _aux_loss_cases(_aux_loss_logits(inputs)):
        x = logits.to(distlab.device()).requires_grad_()
        expert = x.detach().topk(2, dim=-1).indices
        loss = loss_fn(x, expert)
        loss.backward()
        out.append({"loss": loss.detach().cpu(), "grad": x.grad.cpu()})
    return out


@_one_thread
def aux_loss_reference(case: Case, inputs: list | None = None) -> list:
    out = []
    for logits in _aux_loss_cases(_aux_loss_logits(None if inputs is None else inputs[0])):
        x = logits.clone().requires_grad_()
        loss = load_balancing_loss(x, x.detach().topk(2, dim=-1).indices)
        loss.backward()
        out.append({"loss": loss.detach(), "grad": x.grad})
    return out


def aux_loss_judge(case: Case, outputs: list, ref: list) -> list[Line]:
    def value() -> str:
        for i, (got, want) in enumerate(zip(outputs[0], ref)):
            same(got["loss"].reshape(()), want["loss"], f"the loss ({['random', 'skewed'][i]} logits)")
        return f"E x sum_e f_e P_e ({float(ref[0]['loss']):.3f} and {float(ref[1]['loss']):.3f} here)"

    def grad() -> str:
        for i, (got, want) in enumerate(zip(outputs[0], ref)):
            same(got["grad"], want["grad"], f"d loss / d logits ({['random', 'skewed'][i]} logits)")
        return "through P_e only (f_e counts, it has no gradient)"

    return [check_line(case.lines[0], value), check_line(case.lines[1], grad)]


# ---- dispatch and combine (2 and 4 ranks) ----------------------------------------------------------------------

def _dispatch_combine_draw(g: torch.Generator) -> dict[str, torch.Tensor]:
    counts = torch.randint(0, 6, (E,), generator=g)
    counts[int(torch.randint(0, E, (1,), generator=g))] = 0          # an expert nobody on this rank picked
    rows = int(counts.sum())
    return {"counts": counts, "x": torch.randn(rows, H, generator=g), "dy": torch.randn(rows, H, generator=g)}


def dispatch_combine_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [_dispatch_combine_draw(rng) for _ in range(case.world_size)]


def _dispatch_combine_given(n: int, inputs: list | None) -> list[dict[str, torch.Tensor]]:
    return [_dispatch_combine_draw(_gen(30 + 7 * n + r)) for r in range(n)] if inputs is None else inputs


def dispatch_combine_exercise(case: Case, dispatch: Any, combine: Any, inputs: dict | None = None) -> dict:
    r, n, dev = distlab.rank(), distlab.world_size(), distlab.device()
    mine = _dispatch_combine_given(n, None)[r] if inputs is None else inputs
    counts = mine["counts"].to(dev)
    x = mine["x"].to(dev).requires_grad_()
    distlab.engine.runtime.progress("dispatch: counts, then rows")
    with track_comm() as d:
        recv, recv_counts = dispatch(x, counts, None)
    h = recv * (r + 1.0)                        # each rank's "experts": rows scaled by its rank + 1
    distlab.engine.runtime.progress("combine")
    with track_comm() as c:
        y = combine(h, recv_counts, counts, None)
    distlab.engine.runtime.progress("backward")
    with track_comm() as b:
        y.backward(mine["dy"].to(dev))
    return {"recv": recv.detach().cpu(), "recv_counts": recv_counts.cpu(), "y": y.detach().cpu(),
            "grad": x.grad.cpu(), "dispatch": d.stats(), "combine": c.stats(), "backward": b.stats()}


@_one_thread
def dispatch_combine_reference(case: Case, inputs: list | None = None) -> dict:
    n = case.world_size
    given, per = _dispatch_combine_given(n, inputs), E // n
    ranks = []
    for r in range(n):
        recv = [g["x"].split(g["counts"].tolist())[r * per:(r + 1) * per] for g in given]
        owner = torch.arange(E).div(per, rounding_mode="floor").repeat_interleave(given[r]["counts"])
        scale = (owner + 1.0)[:, None]
        ranks.append({"recv": torch.cat([p for src in recv for p in src]),
                      "recv_counts": torch.stack([g["counts"][r * per:(r + 1) * per] for g in given]),
                      "y": given[r]["x"] * scale, "grad": given[r]["dy"] * scale})
    m = th.send_matrix([g["counts"].tolist() for g in given], n)
    return {"ranks": ranks, "m": m}


def dispatch_combine_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    n, m = case.world_size, ref["m"]

    def values() -> str:
        def check(r: int, out: dict) -> None:
            want = ref["ranks"][r]
            same(out["recv_counts"], want["recv_counts"], "dispatch's counts received (N x E/N)", 0, 0)
            same(out["recv"], want["recv"], "dispatch's rows received (by source rank, then expert)")
            same(out["y"], want["y"], "combine's rows (back in this rank's order)")
        return values_line(outputs, check)

    def grads() -> str:
        values_line(outputs, lambda r, out: same(out["grad"], ref["ranks"][r]["grad"],
                                                 "the gradient of the rows through dispatch and combine"))
        return "backward sends every gradient back where its row came from"

    def traffic() -> str:
        for r, out in enumerate(outputs):
            send, back = th.dispatch_bytes(m, r, H, E_BYTES), th.combine_bytes(m, r, H, E_BYTES)
            expect_traffic(f"rank {r}, dispatch", out["dispatch"],
                           {"all_to_all": (2, th.counts_bytes(E, n) + send)})
            expect_traffic(f"rank {r}, combine", out["combine"], {"all_to_all": (1, back)})
            expect_traffic(f"rank {r}, backward", out["backward"], {"all_to_all": (2, send + back)})
        return "dispatch: counts + one uneven all-to-all; combine: one; backward: one each, the formula's bytes"

    return [check_line(case.lines[0], values), check_line(case.lines[1], grads), check_line(case.lines[2], traffic)]


# ---- an expert-parallel layer, trained (2 and 4 ranks) ---------------------------------------------------------

def _model(seed: int, device: Any, group_size: int | None = None) -> torch.nn.Module:
    from dataclasses import replace
    return build_moe_model("tiny", replace(CFG, group_size=group_size), seed=seed, device=device)


def _batch(step: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from distlab.course.models import PRESETS, synthetic_batch
    return synthetic_batch(step, rows, PRESETS["tiny"], seed=seed, device="cpu")


def global_name(name: str, rank: int, per: int) -> str:
    """A rank's parameter name with its local expert index turned into the global one."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(rank * per + int(parts[i]))
    return ".".join(parts)


def ep_layer_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    n, seed = case.world_size, draw_seed(rng)
    weights = drawn_weights(_model(draw_seed(rng), "cpu"), "w.")
    out = []
    for r in range(n):
        mine = dict(weights)
        for s in range(STEPS):
            x, y = _batch(s, ROWS * n, seed)
            mine[f"x{s}"], mine[f"y{s}"] = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        out.append(mine)
    return out


def ep_layer_exercise(case: Case, ep_cls: Any, inputs: dict | None = None) -> dict:
    r, n, dev = distlab.rank(), distlab.world_size(), distlab.device()
    model = _model(4, dev)
    if inputs is not None:
        load_weights(model, inputs, "w.")
    for block in model.blocks:
        block.moe = ep_cls(block.moe, None)
    experts = {id(p) for b in model.blocks for p in b.moe.experts.parameters()}
    dense = [p for p in model.parameters() if id(p) not in experts]
    opt = make_optimizer(model.parameters())
    losses, stats = [], []
    for s in range(STEPS):
        distlab.engine.runtime.progress(f"ep_layer: step {s}")
        if inputs is None:
            x, y = _batch(s, ROWS * n, 0)
            x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        else:
            x, y = inputs[f"x{s}"], inputs[f"y{s}"]
        with track_comm() as m:
            loss = moe_loss(model, x.to(dev), y.to(dev), aux_weight=AUX)
            loss.backward()
        stats.append(m.stats())
        # The data-parallel part (the check's, not yours): dense gradients averaged over the ranks; each
        # expert's gradient already sums every rank's tokens: divided by N, as the mean over ranks is.
        flat = torch.cat([p.grad.reshape(-1) for p in dense])
        dist.all_reduce(flat)
        for p, g in zip(dense, flat.split([p.numel() for p in dense])):
            p.grad.copy_(g.view_as(p) / n)
        for b in model.blocks:
            for p in b.moe.experts.parameters():
                if p.grad is not None:
                    p.grad.div_(n)
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()], device=dev)
        dist.all_reduce(t)
        losses.append(t.item() / n)
    return {"losses": losses, "params": {k: p.detach().cpu() for k, p in model.named_parameters()},
            "comm": stats, "per": len(model.blocks[0].moe.experts)}


@_one_thread
def ep_layer_reference(case: Case, inputs: list | None = None) -> dict:
    n = case.world_size
    model = _model(4, "cpu", group_size=ROWS * 16)
    if inputs is not None:
        load_weights(model, inputs[0], "w.")
    opt = make_optimizer(model.parameters())
    losses, kept = [], []
    for s in range(STEPS):
        if inputs is None:
            x, y = _batch(s, ROWS * n, 0)
        else:
            x, y = (torch.cat([i[f"{k}{s}"] for i in inputs]) for k in "xy")
        loss = moe_loss(model, x, y, aux_weight=AUX)
        loss.backward()
        kept.append([b.moe.stats.kept.tolist() for b in model.blocks])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}, "kept": kept}


def ep_layer_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    n, per = case.world_size, E // case.world_size

    def values() -> str:
        def check(r: int, out: dict) -> None:
            same(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), "the losses", TRAIN_ATOL, TRAIN_RTOL)
            expect(out["per"] == per, f"{out['per']} experts per MoE layer; expected E/N = {per}")
            got = {global_name(k, r, per): v for k, v in out["params"].items()}
            want = {k for k in ref["params"] if ".experts." not in k or int(k.split(".")[4]) // per == r}
            expect(set(got) == want, f"parameters {sorted(set(got) - want)[:3]} are not this rank's; "
                                     f"missing {sorted(want - set(got))[:3]} (keep router and experts)")
            for k in sorted(want):
                same(got[k], ref["params"][k], f"{k} after {STEPS} steps", TRAIN_ATOL, TRAIN_RTOL)
        values_line(outputs, check)
        return f"{STEPS} steps match one process, each rank holding its {per} of {E} experts"

    def traffic() -> str:
        for r, out in enumerate(outputs):
            expect(len(out["comm"]) == STEPS, f"rank {r}: {len(out['comm'])} metered steps, expected {STEPS}")
            for s, stats in enumerate(out["comm"]):
                calls, total = 0, 0
                for kept in ref["kept"][s]:                  # one MoE layer: kept[g][e], g = the rank
                    m = th.send_matrix(kept, n)
                    calls += 5
                    total += th.counts_bytes(E, n) + 2 * (th.dispatch_bytes(m, r, D, E_BYTES)
                                                          + th.combine_bytes(m, r, D, E_BYTES))
                expect_traffic(f"rank {r}, step {s}", stats, {"all_to_all": (calls, total)})
        return "per MoE layer: counts + 2 uneven all-to-alls forward, 2 backward; the formula's bytes"

    return [check_line(case.lines[0], values), check_line(case.lines[1], traffic)]


TASKS = table(
    task("router", "route",
         per_ranks((1,), "router, top-k and gates", "router, capacity: kept assignments and their order"),
         inputs=router_inputs, exercise=router_exercise, reference=router_reference, judge=router_judge),
    task("aux_loss", "aux_loss",
         per_ranks((1,), "aux_loss, value", "aux_loss, gradient"),
         inputs=aux_loss_inputs, exercise=aux_loss_exercise, reference=aux_loss_reference, judge=aux_loss_judge),
    task("dispatch_combine", ("dispatch", "combine"),
         per_ranks((2, 4), "dispatch_combine, {n} ranks, values", "dispatch_combine, {n} ranks, gradients",
                   "dispatch_combine, {n} ranks, traffic"),
         inputs=dispatch_combine_inputs, exercise=dispatch_combine_exercise, reference=dispatch_combine_reference,
         judge=dispatch_combine_judge, hang_hint=HANG_HINT),
    task("ep_layer", "ExpertParallelMoE",
         per_ranks((2, 4), "ep_layer, {n} ranks, losses and parameters", "ep_layer, {n} ranks, traffic per step"),
         inputs=ep_layer_inputs, exercise=ep_layer_exercise, reference=ep_layer_reference, judge=ep_layer_judge,
         hang_hint=HANG_HINT),
)

grade = grader(TASKS)
