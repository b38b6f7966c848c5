"""Chapter 8's measurements: the rank functions behind the lecture's figures, and their one-process references.

The lecture writes the ideas — the GPipe and 1F1B tables, the `PipelineRunner` that walks them, the
offloaded optimizer, Megatron's f and g, ZeRO-1 — and passes them in; these functions build the
stages, run the steps under the meters and return what they measured:

    per_rank = distlab.launch(check_pipeline, 4, args=(PipelineRunner, {"gpipe": gpipe, "1f1b": one_f_one_b}, 6))
    measured = distlab.launch(sweep, 4, args=(PipelineRunner, schedules, (1, 2, 4), cost, 2))
    bubble_of(measured, "1f1b", 4)                      # the bubble read off the timelines

Meters: traffic from `track_comm` (algorithmic bytes: point-to-point sends between stages,
collectives inside a group), memory from `track_memory` (exact on CPU ranks, the allocator on
GPUs), timelines from `distlab.meters.Timeline` (stages cost a fixed, calibrated sleep:
`distlab.course.pipeline.stages.FixedCost`), copies between device and host from
`distlab.course.offload.track_transfers`. Every tensor a rank makes is placed on `rt.device()`;
the one-process references run on the CPU.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.course.models import PRESETS, build_model, lm_loss, num_params, synthetic_batch
from distlab.course.offload import host_device_split, track_transfers
from distlab.course.pipeline.stages import (FixedCost, Stage, _rows, activation_bytes, activation_dtype,
                                            activation_shape,
                                            backward_transient_bytes,
                                            bubble, build_stage, busy_per_microbatch, stage_loss, step_window)
from distlab.engine import runtime as rt
from distlab.engine.precision import MixedPrecisionAdam
from distlab.meters import Timeline, model_state, sync, time_call, track_comm, track_memory

# A schedule: (stages p, micro-batches m, rank r) -> [("F", i), ("B", i), ...], rank r's actions in order.
Schedule = Callable[[int, int, int], list]


def pipeline_runner(runner: type, stage: nn.Module, micro: int) -> Any:
    """`runner(stage, prev=, next=, shape=)` for this rank in a pipeline of all the ranks: its neighbours
    are ranks r - 1 and r + 1 (None at the ends); one micro-batch of `micro` rows crosses each boundary."""
    r, p = rt.rank(), rt.world_size()
    return runner(stage, prev=r - 1 if r > 0 else None, next=r + 1 if r < p - 1 else None,
                  shape=activation_shape(stage.config, micro))


# ---- sections 3-5: the hand-written runner ------------------------------------------------------------------

def check_pipeline(runner: type, schedules: Mapping[str, Schedule], m: int, micro: int = 2) -> dict[str, Any]:
    """One step of each schedule on the 4-block "tiny" model cut into one stage per rank, m micro-batches.

    Per schedule: the mean `loss` (last rank; None elsewhere), `comm`: the point-to-point traffic
    (one activation per micro-batch forward, its gradient back, per stage boundary), and `grads`:
    this stage's gradients under their names in the whole model.
    """
    r, p = rt.rank(), rt.world_size()
    x, y = synthetic_batch(0, m * micro, PRESETS["tiny"])
    out = {}
    for name, schedule in schedules.items():
        stage = build_stage("tiny", r, p, n_layers=4)
        with track_comm() as comm:
            loss = pipeline_runner(runner, stage, micro).step(schedule(p, m, r), m, x if r == 0 else None,
                                                              y if r == p - 1 else None)
        out[name] = {"loss": loss, "comm": comm.stats(),
                     "grads": {stage.full_names[n]: q.grad for n, q in stage.named_parameters()}}
    return out


def stage_compute_s(repeats: int) -> float:
    """Seconds of one middle stage's forward + backward (one block, a micro-batch of 2 rows): the fastest of
    `repeats` calls, the least disturbed by other processes. Nothing crosses a wire."""
    stage = build_stage("tiny", 1, 4, n_layers=4)          # a middle stage: one block
    h = torch.randn(activation_shape(stage.config, 2), device=rt.device(), requires_grad=True)
    return min(time_call(lambda: stage(h).sum().backward(), repeats=repeats, warmup=2))


def sweep(runner: type, schedules: Mapping[str, Schedule], ms: Sequence[int], cost: float, repeats: int,
          micro: int = 2) -> dict[Any, Any]:
    """Each schedule for each m, on stages of fixed cost (forward `cost`, backward 2 x `cost`), timed.

    Returns `unit`: the bytes one micro-batch's forward leaves alive on this stage; `transient`: the
    bytes one backward adds while it runs (`backward_transient_bytes`); and for each
    (schedule name, m) a list of `repeats` runs, each {"spans": this rank's F and B spans on a
    `Timeline`, "peak": peak bytes of a step}. The timed steps run without the memory meter (its
    per-operation bookkeeping would add idle time to every slot); one more step per point runs
    under it. Gradients are preallocated, so the peak counts activations. One untimed warm-up per schedule. Crosses the wire: activations and their
    gradients between neighbouring stages.
    """
    warnings.filterwarnings("ignore")
    r, p = rt.rank(), rt.world_size()
    stage = build_stage("tiny", r, p, n_layers=4)
    x1, y1 = synthetic_batch(0, micro, stage.config)
    unit = activation_bytes(stage, x1, y1)                   # one micro-batch's activations on this stage
    transient = backward_transient_bytes(stage, x1, y1)      # what one backward adds while it runs
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)                          # accumulated in place: the peak is activations
    timed = FixedCost(stage, cost, cost, cost)
    run = pipeline_runner(runner, timed, micro)
    out: dict[Any, Any] = {"unit": unit, "transient": transient}
    for name, schedule in schedules.items():
        for k, m in enumerate(ms):
            x, y = synthetic_batch(0, micro * m, stage.config)
            runs = []
            for rep in range(repeats + (k == 0)):             # one untimed warm-up per schedule
                tl = Timeline()
                timed.reset(tl)
                dist.barrier()
                run.step(schedule(p, m, r), m, x if r == 0 else None, y if r == p - 1 else None)
                if rep or k:
                    runs.append({"spans": tl.finish()})
            timed.reset(Timeline())                           # memory: one more step, under the meter
            dist.barrier()
            with track_memory() as mem:                       # (its bookkeeping would stretch the timed steps)
                run.step(schedule(p, m, r), m, x if r == 0 else None, y if r == p - 1 else None)
            for rec in runs:
                rec["peak"] = mem.peak_bytes
            out[name, m] = runs
    return out


def hop_s(runner: type, schedule: Schedule, cost: float, repeats: int, micro: int = 2) -> dict[str, float]:
    """What a pipeline step spends outside its spans, measured apart from the sweeps: on 2 ranks,
    `repeats` steps of one micro-batch (m = 1) through `runner`, stages of fixed cost (as `sweep`).
    Such a step is F on rank 0, F then B on rank 1, B on rank 0. Returns, medians over the steps,
    `gap`: rank 1's time between its F and its B (the runner's bookkeeping between two actions, no
    message waited for), and `hop`: what each of the two messages adds beyond that,
    (window - the four spans - gap) / 2 (the message and the wake-up of the rank that waited).
    Both messages of such a step find their receiver waiting. Each repeat then runs one step of 1F1B's
    table with m = 2 (rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1), where rank 0 sends F1 while rank 1 is
    still in B0: `late`, rank 1's time from the end of its B0 to the start of its F1, is what a message
    costs a receiver that posts its receive after the send (gloo then moves it only on the receiver's
    "ready": a round trip). The schedule model (`predicted_bubble`) takes all three.
    """
    warnings.filterwarnings("ignore")
    r, p = rt.rank(), rt.world_size()
    stage = build_stage("tiny", r, p, n_layers=4)
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)
    timed = FixedCost(stage, cost, cost, cost)
    run = pipeline_runner(runner, timed, micro)
    x, y = synthetic_batch(0, micro, stage.config)
    x2, y2 = synthetic_batch(0, 2 * micro, stage.config)
    two = [("F", 0), ("F", 1), ("B", 0), ("B", 1)] if r == 0 else [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    hops, gaps, lates = [], [], []
    for rep in range(repeats + 1):
        tl = Timeline()
        timed.reset(tl)
        dist.barrier()
        run.step(schedule(p, 1, r), 1, x if r == 0 else None, y if r == p - 1 else None)
        mine = {sp.name: (sp.start, sp.end) for sp in tl.finish()}
        t = torch.tensor([*mine["F0"], *mine["B0"]], dtype=torch.float64, device=rt.device())
        every = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(every, t)                            # perf_counter: one clock for the machine's ranks
        sync()
        rows = [e.tolist() for e in every]                   # per rank: F0 start, F0 end, B0 start, B0 end
        window = max(r_[3] for r_ in rows) - min(r_[0] for r_ in rows)
        busy = sum(r_[1] - r_[0] + r_[3] - r_[2] for r_ in rows)
        gap = rows[-1][2] - rows[-1][1]
        tl = Timeline()
        timed.reset(tl)
        dist.barrier()
        run.step(two if p == 2 else schedule(p, 2, r), 2, x2 if r == 0 else None, y2 if r == p - 1 else None)
        spans = {sp.name: (sp.start, sp.end) for sp in tl.finish()}
        if rep:
            gaps.append(gap)
            hops.append((window - busy - gap) / (2 * (p - 1)))
            lates.append(spans["F1"][0] - spans["B0"][1] if r == p - 1 else 0.0)
    late = torch.tensor(lates, dtype=torch.float64, device=rt.device())
    dist.broadcast(late, src=p - 1)                          # the last rank's, on every rank
    sync()
    return {"hop": statistics.median(hops), "gap": statistics.median(gaps), "late": statistics.median(late.tolist())}


def runner_message_costs(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int, schedule: Schedule,
                         average: Callable[[Sequence[float]], float] = statistics.fmean) -> dict[str, float | None]:
    """`predicted_bubble`'s hop, late and gap read off a `sweep`'s own steps of schedule `name` at m micro-batches
    (the runner's rendezvous: a send completes once its receiver has posted the receive, and the sender waits
    for it). Per measured step, rank and action, against the end of the rank's previous action (`free`), what
    the action started after, the latest of:

    - its input's send (`send`: the end of the producing action on the neighbouring rank), if later than `free`:
      the receiver waited, `hop` = start - send;
    - the post of the receive that takes its previous action's message (`at`: the end of the action before the
      consuming one on the neighbour), if later than `free`: the sender waited for a late receiver, `late` =
      start - at;
    - `free` itself, when a message was involved (an input sent before the rank got there: `late`, the receiver's
      round trip; or its own send to a receiver already waiting: `hop`);
    - with no message either way, `gap` = start - free.

    `average` over every such action of every step (the mean: a step adds them up). None where the steps have no
    action of a kind. Unlike `hop_s` (2 ranks, m = 1 and 2, measured apart, the last stage's loss inside its
    gap) these are the sweep point's own: its ranks, its load, its kinds of wait."""
    p = len(per_rank)
    orders = [[f"{k}{i}" for k, i in schedule(p, m, r)] for r in range(p)]
    seen: dict[str, list[float]] = {"hop": [], "late": [], "gap": []}
    for runs in zip(*(rank[name, m] for rank in per_rank)):
        spans = [{x["name"]: x for x in _rows(run["spans"])} for run in runs]
        for r, seq in enumerate(orders):
            for j in range(1, len(seq)):
                action, prev = seq[j], seq[j - 1]
                free, start = spans[r][prev]["end"], spans[r][action]["start"]
                refs: list[tuple[float, str]] = []                    # (reference time, kind of wait)
                to = r + 1 if prev[0] == "F" else r - 1               # who receives my previous action's message
                if 0 <= to < p:
                    k = orders[to].index(prev)
                    at = spans[to][orders[to][k - 1]]["end"] if k else float("-inf")
                    refs.append((at, "late") if at > free else (free, "hop"))
                src = r - 1 if action[0] == "F" else r + 1            # who sends my input
                if 0 <= src < p:
                    send = spans[src][action]["end"]
                    refs.append((send, "hop") if send > free else (free, "late"))
                if not refs:
                    seen["gap"].append(start - free)
                    continue
                t, kind = max(refs)
                if t == free and (free, "late") in refs:              # both at `free`: the round trip is the longer
                    kind = "late"
                seen[kind].append(start - t)
    return {k: average(x) if x else None for k, x in seen.items()}


def predicted_bubble(schedule: Schedule, p: int, m: int, cost: float, hop: float, gap: float = 0.0,
                     late: float | None = None) -> float:
    """The bubble of `schedule` when F costs `cost`, B 2 `cost`, a message between ranks `hop` seconds
    after its send when the receiver waits for it and `late` after the receiver gets there when it was
    sent first (default `hop`), sends wait for their receive (the runners' rendezvous) and a rank spends
    `gap` between two actions: the schedule simulated (`distlab.course.pipeline.simulate`), idle share of
    its window. With hop = gap = late = 0 it is (p - 1)/(m + p - 1) for GPipe and 1F1B."""
    from distlab.course.pipeline.simulate import simulate
    return bubble(simulate(schedule, p, m, t_f=cost, t_b=2 * cost, t_p2p=hop, rendezvous=True, t_gap=gap,
                           t_late=late))


def bubble_of(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int) -> float:
    """The bubble of schedule `name` at m micro-batches in a `sweep`: median over the repeats."""
    runs = zip(*(rank[name, m] for rank in per_rank))
    return statistics.median(bubble([s for rec in run for s in rec["spans"]]) for run in runs)


def timing_of(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int) -> tuple[int, float, float]:
    """(m, step seconds, busy seconds per micro-batch) of schedule `name` in a `sweep`, medians over the repeats."""
    runs = [[s for rec in run for s in rec["spans"]] for run in zip(*(rank[name, m] for rank in per_rank))]
    return (m, statistics.median(step_window(r) for r in runs),
            statistics.median(busy_per_microbatch(r, m) for r in runs))


# ---- section 7: torch.distributed.pipelining ----------------------------------------------------------------

def _timed(pstage: Any, timeline: Timeline, label: Any) -> None:
    """Record each forward / backward / weight-gradient call of a PipelineStage as a span."""
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        original = getattr(pstage, method)

        def wrapped(i: int, *args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
            if _kind == "B" and kwargs.get("full_backward", True):
                _kind = "BW"                                # a whole backward: B and W at once
            with timeline.span(f"{_kind}{i}.{label}"):
                return _original(i, *args, **kwargs)
        setattr(pstage, method, wrapped)


def torch_schedules(schedules: Mapping[str, int], m: int, cost: float, micro: int = 2,
                    repeats: int = 1) -> dict[str, Any]:
    """PyTorch's schedules (`torch.distributed.pipelining.schedules`, name -> chunks per rank v) on the
    8-block "tiny" model in p x v chunks, each with a fixed cost of cost / v for F, B and W.

    Rank r holds chunks r, r + p, ... (ZBV: r and 2p - 1 - r). One untimed step (shapes are inferred
    there), then `repeats` measured steps. Per schedule: `steps` (per measured step, this rank's F, B,
    W, or BW for a whole backward), `spans` (the first's), mean `loss` (of the last step, on the rank
    with the last chunk; None elsewhere), `comm`: the first measured step's sends and receives
    between chunks, `grads` (of the last step) under their names in the whole model, `chunks`: the
    stages this rank holds, and for the schedules that run from a table (v > 1) `order`: this rank's
    actions as PyTorch's table lists them, ("F" | "B" | "W", micro-batch, chunk) with chunk an index into
    `chunks` (its "I", the input-gradient half of a split backward, is "B"), for
    `distlab.course.pipeline.simulate`, and `posts`: where PyTorch's lowered table posts each of those actions'
    receives (`_posts`; None for the single-stage schedules).
    """
    warnings.filterwarnings("ignore")
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S
    r, p = rt.rank(), rt.world_size()
    out = {}
    for name, v in schedules.items():
        n = p * v
        chunks = [r, n - 1 - r] if name == "ScheduleZBVZeroBubble" else [r + k * p for k in range(v)]
        tl, stages, pstages = Timeline(), [], []
        for c in chunks:
            stage = build_stage("tiny", c, n, n_layers=8)
            stages.append(stage)
            ps = PipelineStage(FixedCost(stage, cost / v, cost / v, cost / v), c, n, rt.device())
            _timed(ps, tl, c)
            pstages.append(ps)
        sched = getattr(S, name)(pstages[0] if v == 1 else pstages, n_microbatches=m, loss_fn=stage_loss)
        x, y = synthetic_batch(0, micro * m, stages[0].config)
        losses: list[Any] = []
        args = (x,) if 0 in chunks else ()
        kwargs = {"target": y, "losses": losses} if n - 1 in chunks else {}
        sched.step(*args, **kwargs)                          # warm-up (shapes are inferred here)
        steps = []
        for k in range(repeats):
            for st in stages:
                st.zero_grad(set_to_none=True)
            tl.finish().clear()                              # (on GPUs, finish() reads the CUDA events)
            losses.clear()
            dist.barrier()
            with track_comm() as comm:
                sched.step(*args, **kwargs)
            steps.append(list(tl.finish()))
            if k == 0:
                first_comm = comm.stats()
        table = getattr(sched, "pipeline_order", None)
        order = None if not table else [({"I": "B"}.get(a.computation_type.value, a.computation_type.value),
                                         a.microbatch_index, chunks.index(a.stage_index))
                                        for a in table[r] if a is not None]
        lowered = getattr(sched, "pipeline_order_with_comms", None)
        posts = None if not lowered else _posts(lowered[r], order, chunks)
        out[name] = {"spans": steps[0], "steps": steps, "loss": sum(float(v) for v in losses) / m if losses else None,
                     "comm": first_comm, "chunks": chunks, "order": order, "posts": posts,
                     "grads": {st.full_names[k]: q.grad for st in stages for k, q in st.named_parameters()}}
    return out


def _posts(lowered: Sequence[Any], order: Sequence[tuple], chunks: Sequence[int]) -> list[int | None]:
    """For each action of `order`, how many of this rank's compute actions run before its receive is posted in
    PyTorch's lowered table (`pipeline_order_with_comms`: RECV_F / RECV_B actions placed by `_add_send_recv`);
    None for an action that receives nothing from another rank."""
    posted: dict[tuple[str, int, int], int] = {}
    done = 0
    for a in lowered:
        kind = a.computation_type.value
        if kind in ("RECV_F", "RECV_B"):
            posted[("F" if kind == "RECV_F" else "B", a.microbatch_index, a.stage_index)] = done
        elif kind in ("F", "I", "B", "W"):
            done += 1
    return [posted.get((k, i, chunks[c])) for k, i, c in order]


def overheads_of(per_rank: Sequence[Mapping[str, Any]], name: str) -> dict[str, float]:
    """`hop_s`'s two terms for PyTorch's schedule `name`, read off a `torch_schedules` run on 2 ranks with
    m = 1 (one chunk each): per measured step, rank 0 runs F, rank 1 F then its whole backward, rank 0
    its backward. `gap`: rank 1's time between its F and its backward (PyTorch's bookkeeping between two
    actions, the loss included); `hop`: what each of the two messages adds beyond that,
    (window - the four spans - gap) / 2. Medians over the steps. Measured apart from the runs they predict."""
    hops, gaps = [], []
    for steps in zip(*(rank[name]["steps"] for rank in per_rank)):
        rows = [sorted(_rows(s), key=lambda x: x["start"]) for s in steps]
        window = max(r[-1]["end"] for r in rows) - min(r[0]["start"] for r in rows)
        busy = sum(x["end"] - x["start"] for r in rows for x in r)
        gap = rows[-1][1]["start"] - rows[-1][0]["end"]
        gaps.append(gap)
        hops.append((window - busy - gap) / (2 * (len(rows) - 1)))
    return {"hop": statistics.median(hops), "gap": statistics.median(gaps)}


def action_samples(per_rank: Sequence[Mapping[str, Any]], name: str) -> dict[tuple[str, int], list[float]]:
    """Every duration each kind of action of PyTorch's schedule `name` took in a `torch_schedules` run:
    (kind, stage) -> seconds, over every measured step and micro-batch ("B" for a whole backward, "BW" on the
    timelines)."""
    seen: dict[tuple[str, int], list[float]] = {}
    for r, rank in enumerate(per_rank):
        chunks = rank[name]["chunks"]
        for step in rank[name]["steps"]:
            for sp in _rows(step):
                head, _, stage = sp["name"].partition(".")
                kind = head.rstrip("0123456789")
                seen.setdefault(({"BW": "B"}.get(kind, kind), int(stage) if stage else chunks[0]), []).append(
                    sp["end"] - sp["start"])
    return seen


def action_costs(per_rank: Sequence[Mapping[str, Any]], name: str) -> Callable[[str, int, int], float]:
    """What each action of PyTorch's schedule `name` cost in a `torch_schedules` run, for `simulate`'s `cost_of`:
    (kind, micro-batch, stage) -> the mean seconds of that kind of action on that stage over every measured
    step and micro-batch (`action_samples`; the mean, not the median: a step adds up its actions, the slow ones
    too). The fixed cost's split as it really ran: a zero-bubble stage 0 has no input gradient to compute (its
    input is token ids), so its "I" step costs almost nothing and its W carries the whole backward; and each
    includes PyTorch's own work inside the call (the split backward's two halves each a little over c / v)."""
    costs = {k: statistics.fmean(x) for k, x in action_samples(per_rank, name).items()}
    return lambda kind, i, stage: costs.get((kind, stage))


def torch_posts(per_rank: Sequence[Mapping[str, Any]], name: str) -> Callable[[int], list] | None:
    """For `simulate`'s `posts`: where PyTorch's lowered table of schedule `name` posts each receive (rank ->
    per action of its `order`, how many of its actions run before that receive is posted); None for the
    single-stage schedules, which post each receive when they reach the action that needs it."""
    posts = [rank[name].get("posts") for rank in per_rank]
    if any(x is None for x in posts):
        return None
    return lambda r: posts[r]


def late_of(per_rank: Sequence[Mapping[str, Any]], name: str = "Schedule1F1B") -> float:
    """PyTorch's late receiver, measured apart: on a `torch_schedules` run of `Schedule1F1B` on 2 ranks with m = 2,
    rank 1's time from the end of its first backward to the start of its second forward. Rank 0 sent that
    forward's input long before (its warm-up runs both forwards), so this is what a receive posted after its
    message was sent costs (`simulate`'s `t_late`; its bookkeeping between the two actions included). Median
    over the measured steps."""
    lates = []
    for step in per_rank[1][name]["steps"]:
        spans = {sp["name"].partition(".")[0]: sp for sp in _rows(step)}
        lates.append(spans["F1"]["start"] - spans["BW0"]["end"])
    return statistics.median(lates)


def message_costs(per_rank: Sequence[Mapping[str, Any]], name: str,
                  average: Callable[[Sequence[float]], float] = statistics.fmean) -> dict[str, float | None]:
    """`simulate`'s `t_p2p`, `t_late` and `t_gap` read off the run of schedule `name` itself (a `torch_schedules`
    run): paired with the steps they predict, the same launch, ranks and load. Per measured step and rank, each
    action's start against the end of the action whose output it needs (`send`: its input's producer on
    another rank), when its receive was posted (`post`: the end of the action `torch_posts` names; for the
    single-stage schedules, when the rank got to the action) and when its rank got free (`free`: the end of its
    previous action):

    - `hop`: start - send, for each receive posted and rank free before the send ended (the receiver waits);
    - `late`: start - post, for each receive posted after the send ended, right before its action (a late
      receiver's round trip, the bookkeeping between the two actions included, as `late_of`; in a ramp of
      forwards most receives are posted a moment after their send, and pay it);
    - `gap`: start - free, for each action whose input is on its own rank, or was sent and its receive posted
      at least 5 ms before the rank got free (nothing waited for).

    `average` over every such action of every step: the mean by default, not the median — a step adds these
    delays up along its chain of actions, the slow ones too, and on a shared machine they have a long tail (as
    `action_costs`). None where the run has no action of a kind. Unlike `overheads_of` and `late_of` (2 ranks,
    measured apart, under the load of another moment) these carry the load under which the steps ran."""
    chunks = [rank[name]["chunks"] for rank in per_rank]
    owner = {s: r for r, cs in enumerate(chunks) for s in cs}
    posts = [rank[name].get("posts") for rank in per_rank]
    hops: list[float] = []
    lates: list[float] = []
    gaps: list[float] = []
    for steps in zip(*(rank[name]["steps"] for rank in per_rank)):
        ends: dict[tuple[str, int, int], float] = {}
        rows = []
        for r, step in enumerate(steps):
            mine = sorted(_rows(step), key=lambda x: x["start"])
            rows.append(mine)
            for sp in mine:
                head, _, stage = sp["name"].partition(".")
                kind = head.rstrip("0123456789")
                key = "F" if kind == "F" else "W" if kind == "W" else "B"      # BW and I: the input gradient
                ends[(key, int(head[len(kind):]), int(stage))] = sp["end"]
        for r, mine in enumerate(rows):
            for j, sp in enumerate(mine):
                if j == 0:
                    continue
                head, _, stage = sp["name"].partition(".")
                kind = head.rstrip("0123456789")
                i, s = int(head[len(kind):]), int(stage)
                src = s - 1 if kind == "F" else s + 1 if kind in ("B", "BW") else None
                free = mine[j - 1]["end"]
                send = None if src is None or src not in owner or owner[src] == r else ends.get(
                    ("F" if kind == "F" else "B", i, src))
                if send is None:
                    gaps.append(sp["start"] - free)
                    continue
                k = posts[r][j] if posts[r] is not None and j < len(posts[r]) else j
                post = mine[k - 1]["end"] if k else None
                if post is None:
                    continue
                if post <= send and free <= send:
                    hops.append(sp["start"] - send)
                elif post > send and k == j:
                    lates.append(sp["start"] - post)
                if send + 0.005 <= free and (post <= send or post + 0.005 <= free):
                    gaps.append(sp["start"] - free)          # the message was there long before
    return {k: average(x) if x else None for k, x in (("hop", hops), ("late", lates), ("gap", gaps))}


def drawn_bubble(per_rank: Sequence[Mapping[str, Any]], name: str, schedule: Callable[..., Sequence[tuple]], p: int,
                 m: int, *, late: float, draws: int = 200, seed: int = 0, **costs: Any) -> float:
    """The bubble `simulate` predicts for PyTorch's schedule `name` with the spread its own run showed, not only
    its means: each action's duration drawn from what that kind of action took on that stage (`action_samples`),
    each message's and pause's delay from the hops, late receivers and gaps `message_costs` read off the same
    steps; the mean bubble over `draws` seeded draws. A step's length is the longest chain of delays through its
    joins (an action starts when the later of its inputs is there), so a delay that varies lengthens it on
    average, even with the same mean: the means alone under-predict, most where a schedule leaves no slack
    (the zero-bubble tables). `late`: the late receiver's delay where the run had none (GPipe's table). `costs`:
    `simulate`'s (t_f, t_b, t_w, v, stage_of), `posts` from the run (`torch_posts`)."""
    import random

    from distlab.course.pipeline.simulate import simulate
    spread = message_costs(per_rank, name, average=list)
    acts = action_samples(per_rank, name)
    rng = random.Random(seed)
    hops, gaps, lates = spread["hop"], spread["gap"], spread["late"] or [late]

    def cost_of(kind: str, i: int, stage: int) -> float | None:
        seen = acts.get((kind, stage))
        return rng.choice(seen) if seen else None

    runs = [bubble(simulate(schedule, p, m, t_p2p=lambda: rng.choice(hops), t_gap=lambda: rng.choice(gaps),
                            t_late=lambda: rng.choice(lates), posts=torch_posts(per_rank, name), cost_of=cost_of,
                            **costs))
            for _ in range(draws)]
    return statistics.fmean(runs)


def torch_order(per_rank: Sequence[Mapping[str, Any]], name: str) -> tuple[Callable[..., list], Callable[[int, int], int]]:
    """PyTorch's own table of schedule `name` from a `torch_schedules` run, for `simulate`: the schedule
    (p, m, r) -> rank r's actions, and `stage_of(r, c)` -> the stage of rank r's chunk c (ZBV's "V")."""
    orders = [rank[name]["order"] for rank in per_rank]
    chunks = [rank[name]["chunks"] for rank in per_rank]
    if any(o is None for o in orders):
        raise ValueError(f"{name} runs without a table: simulate the course's own order instead")
    return (lambda p, m, r: orders[r]), (lambda r, c: chunks[r][c])


def traced_pipeline(m: int, micro: int = 2) -> dict[str, Any]:
    """`pipeline()` traces the 4-block "tiny" model and cuts it before block 2 (`SplitPoint`); one GPipe step.

    Returns `trace_s`: seconds the tracing took on this rank, `stages`, and the mean `loss` (last rank).
    """
    warnings.filterwarnings("ignore")
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
    r = rt.rank()
    model = build_model("tiny", n_layers=4)
    x, y = synthetic_batch(0, micro * m, model.config)
    made = {}                                          # a module can be traced once
    seconds = time_call(lambda: made.setdefault("pipe", pipeline(model, mb_args=(x[:micro],),
                                                                 split_spec={"blocks.2": SplitPoint.BEGINNING})),
                        repeats=1, warmup=0)[0]
    pipe = made["pipe"]
    sched = ScheduleGPipe(pipe.build_stage(r, rt.device()), m, loss_fn=stage_loss)
    losses: list[Any] = []
    sched.step(x) if r == 0 else sched.step(target=y, losses=losses)
    return {"trace_s": seconds, "stages": pipe.num_stages, "loss": sum(float(v) for v in losses) / m if losses else None}


# ---- section 8: offload ----------------------------------------------------------------------------------------

def offload_demo(offload: type, preset: str, steps: int) -> dict[str, Any]:
    """Model `preset` in bf16 trained by `offload(params, timeline=, lr=)` (the lecture's ZeRO-Offload) beside
    the same model with `MixedPrecisionAdam` on the device, on the same batches.

    Returns `psi`; `moved`: per step, the bytes copied device -> host during the backward and host ->
    device during the optimizer step (`track_transfers`); `same`: whether the parameters came out
    identical; `spans`: the last step's timeline (backward, gradient copies, host Adam); `overlap`: the
    share of the copies' time inside the backward (`copies_inside`; None if no copy span); `peaks`: peak
    bytes of one more step of each under `track_memory`; "offload" and "plain": bytes each keeps on
    the device and on the host (`host_device_split`). One rank; nothing crosses a network.
    """
    model = build_model(preset, seed=0).to(torch.bfloat16)
    plain_model = build_model(preset, seed=0).to(torch.bfloat16)
    tl = Timeline()
    opt = offload(model.parameters(), timeline=tl, lr=1e-3)
    plain = MixedPrecisionAdam(plain_model.parameters(), lr=1e-3)
    moved = []
    for step in range(steps):
        x, y = synthetic_batch(step, 8, model.config)
        tl.finish().clear()                                  # keep the last step only
        with track_transfers(model) as down:
            with tl.span("backward"):
                lm_loss(model, x, y).backward()
        with track_transfers(model) as up:
            with tl.span("host Adam + copy up"):
                opt.step()
        lm_loss(plain_model, x, y).backward()
        plain.step()
        if step < steps - 1:
            plain.zero_grad(set_to_none=True)          # the last step's gradients stay: the plain peak
        moved.append((down.stats()["down_bytes"], up.stats()["up_bytes"]))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    last = tl.finish()
    overlap = copies_inside(last, "copy down", "backward")
    split = {"offload": host_device_split(model, opt), "plain": host_device_split((plain_model, plain))}
    plain.zero_grad(set_to_none=True)
    opt.timeline = None                           # the timeline shows the last step above, not this one
    peaks = {}                                    # one more step of each under the memory meter
    for name, m_, step_fn in (("offload", model, opt.step), ("plain", plain_model, plain.step)):
        with track_memory() as mem:               # CUDA: allocator statistics; CPU: every tensor, host too
            lm_loss(m_, x, y).backward()
            step_fn()
        peaks[name] = mem.peak_bytes
    return {"psi": num_params(model), "moved": moved, "same": same, "spans": last, "backend": rt.backend(),
            "peaks": peaks, "overlap": overlap, **split}


def copies_inside(spans: Sequence[Any], copy: str, window: str) -> float | None:
    """Share of the seconds spent in spans named `copy` that fall inside the span named `window`
    (None when there are no such copies, e.g. on a GPU, where they run on the copy engine unseen)."""
    rows = [s if isinstance(s, Mapping) else s.__dict__ for s in spans]
    win = [(r["start"], r["end"]) for r in rows if r["name"] == window]
    cps = [(r["start"], r["end"]) for r in rows if r["name"] == copy]
    total = sum(e - s for s, e in cps)
    if not win or total <= 0:
        return None
    a, b = win[0]
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in cps) / total


def fsdp_offload(preset: str, steps: int) -> dict[str, Any]:
    """FSDP2 with `CPUOffloadPolicy` on every block and the root, AdamW, 8 rows per step split over the ranks.

    Returns the mean `losses` (all-reduced), `where` the parameter shards live, `state` (`ModelState`
    at the last step boundary), `moved`: the last step's device <-> host copies, `comm`: its
    collectives (all-gathers of parameter shards, reduce-scatters of gradients).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from distlab.course.models import split_batch
    model = build_model(preset, seed=0)
    policy = CPUOffloadPolicy(pin_memory=rt.device().type == "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=rt.mesh(), offload_policy=policy)
    fully_shard(model, mesh=rt.mesh(), offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = split_batch(synthetic_batch(step, 8, model.config), rt.rank(), rt.world_size())
        with track_transfers(model) as moved, track_comm() as comm:
            loss = lm_loss(model, x, y)
            loss.backward()
        opt.step()
        state = model_state(model, optimizer=opt)       # at the step boundary, gradients included
        opt.zero_grad()
        t = loss.detach().reshape(1).to(rt.device())
        dist.all_reduce(t)
        losses.append(t.item() / rt.world_size())
    where = {str(q.to_local().device) for q in model.parameters()}
    return {"losses": losses, "where": where, "state": state, "backend": rt.backend(),
            "moved": moved.stats(), "comm": comm.stats()}


# ---- section 9: the 3-D mesh ---------------------------------------------------------------------------------

def train_3d(shape: tuple[int, int, int], steps: int, m: int, micro: int, lr: float, n_layers: int = 4, *,
             runner: type, block: type, optimizer: type, schedule: Schedule) -> dict[str, Any]:
    """Train the "tiny" model (bf16) on a ("pp", "dp", "tp") mesh of `shape` = (pp, dp, tp), one rank per
    mesh point. The order is the course's one order (the planner's too, torchtitan's): tp innermost
    (neighbouring ranks, one node: the heaviest, latency-critical traffic), dp next, pp outermost
    (its point-to-point activations are the lightest traffic, so its groups may span the slowest links).

    The rank keeps its stage (pp coordinate), replaces each block by `block(b, tp_group)` when tp > 1,
    runs `schedule` through `runner` between its pipeline neighbours (same dp and tp), on its dp
    replica's m x micro rows, then `optimizer(stage.parameters(), dp_group, lr=lr).step()`.
    Returns its `coord`, `losses` (last stage; None elsewhere), `state` (the optimizer's
    `state()`), `comm`: the first step's traffic (all-reduces in tp, sends in pp, reduce-scatter
    and all-gather in dp), `local_params` and `act_bytes` (bytes per activation element).
    """
    warnings.filterwarnings("ignore")
    names = ("pp", "dp", "tp")
    mesh = rt.mesh(*shape, names=names)
    coord = dict(zip(names, mesh.get_coordinate()))
    pp, dp, tp = shape
    s = coord["pp"]
    stage = Stage(build_model("tiny", seed=0, n_layers=n_layers).to(torch.bfloat16), s, pp)
    if tp > 1:
        stage.blocks = nn.ModuleList(block(b, mesh.get_group("tp")) for b in stage.blocks)
    at = lambda k: int(mesh.mesh[k, coord["dp"], coord["tp"]]) if 0 <= k < pp else None   # my pipeline's ranks
    act_dtype = activation_dtype(stage.config, storage=torch.bfloat16)
    run = runner(stage, prev=at(s - 1), next=at(s + 1), shape=activation_shape(stage.config, micro), dtype=act_dtype)
    opt = optimizer(stage.parameters(), mesh.get_group("dp"), lr=lr)
    rows = m * micro
    losses, comm = [], None
    for step in range(steps):
        x, y = synthetic_batch(step, dp * rows, stage.config)
        mine = slice(coord["dp"] * rows, (coord["dp"] + 1) * rows)
        with track_comm() as meter:
            loss = run.step(schedule(pp, m, s), m, x[mine] if s == 0 else None, y[mine] if s == pp - 1 else None)
            opt.step()
        comm = comm or meter.stats()
        losses.append(loss)
    return {"coord": coord, "losses": losses, "state": opt.state(), "comm": comm, "backend": rt.backend(),
            "local_params": sum(q.numel() for q in stage.parameters()),
            "act_bytes": torch.empty((), dtype=act_dtype, device=rt.device()).element_size()}


def reference_bf16(steps: int, batch: int, lr: float, n_layers: int = 4) -> list[float]:
    """One process, the whole batch, the same bf16 weights and `MixedPrecisionAdam`, on the CPU: the ground
    truth for `train_3d`. The loss of each step."""
    model = build_model("tiny", seed=0, n_layers=n_layers, device="cpu").to(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, batch, model.config, device="cpu")
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
