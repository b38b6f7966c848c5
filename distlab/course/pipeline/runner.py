"""Chapter 8, sections 3-5: the harness around the lecture's `PipelineRunner` (which the notebook writes).

    per_rank = distlab.launch(check_pipeline, 4, args=(PipelineRunner, {"gpipe": gpipe, "1f1b": one_f_one_b}, 6))
    measured = distlab.launch(sweep, 4, args=(PipelineRunner, schedules, (1, 2, 4), cost, 2))
    bubble_of(measured, "1f1b", 4)                      # the bubble read off the timelines (median of the steps)
    hop_of(measured, "gpipe")                           # one message's cost, read off the m = 1 steps

These functions build each rank's stage, run the runner's steps under the meters and read the timelines;
the schedule tables and the runner that sends and receives come in as arguments. Traffic from `track_comm`
(point-to-point sends between neighbouring stages), memory from `track_memory`, timelines from
`distlab.meters.Timeline` (stages cost a fixed, calibrated sleep: `distlab.course.pipeline.fixed_cost.FixedCost`).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.course.models import PRESETS, synthetic_batch
from distlab.course.pipeline.bubble import bubble, busy_per_microbatch, step_window
from distlab.course.pipeline.fixed_cost import FixedCost
from distlab.course.pipeline.stages import activation_bytes, activation_shape, backward_transient_bytes, build_stage
from distlab.engine import runtime as rt
from distlab.meters import Timeline, time_call, track_comm, track_memory

# A schedule: (stages p, micro-batches m, rank r) -> [("F", i), ("B", i), ...], rank r's actions in order.
Schedule = Callable[[int, int, int], list]


def pipeline_runner(runner: type, stage: nn.Module, micro: int) -> Any:
    """`runner(stage, prev=, next=, shape=)` for this rank in a pipeline of all the ranks: its neighbours
    are ranks r - 1 and r + 1 (None at the ends); one micro-batch of `micro` rows crosses each boundary."""
    r, p = rt.rank(), rt.world_size()
    return runner(stage, prev=r - 1 if r > 0 else None, next=r + 1 if r < p - 1 else None,
                  shape=activation_shape(stage.config, micro))


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
    under it. Gradients are preallocated, so the peak counts activations. One untimed warm-up per
    schedule. Crosses the wire: activations and their gradients between neighbouring stages.
    """
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
            args = (schedule(p, m, r), m, x if r == 0 else None, y if r == p - 1 else None)
            runs = []
            for rep in range(repeats + (k == 0)):             # one untimed warm-up per schedule
                tl = Timeline()
                timed.reset(tl)
                dist.barrier()
                run.step(*args)
                if rep or k:
                    runs.append({"spans": tl.finish()})
            timed.reset(Timeline())                           # memory: one more step, under the meter
            dist.barrier()
            with track_memory() as mem:                       # (its bookkeeping would stretch the timed steps)
                run.step(*args)
            for rec in runs:
                rec["peak"] = mem.peak_bytes
            out[name, m] = runs
    return out


def step_bubbles(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int) -> list[float]:
    """The bubble of each measured step of schedule `name` at m micro-batches in a `sweep`, in order."""
    return [bubble([s for rec in run for s in rec["spans"]]) for run in zip(*(rank[name, m] for rank in per_rank))]


def bubble_of(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int) -> float:
    """The bubble of schedule `name` at m micro-batches in a `sweep`: median over the repeats."""
    return statistics.median(step_bubbles(per_rank, name, m))


def timing_of(per_rank: Sequence[Mapping[Any, Any]], name: str, m: int) -> tuple[int, float, float]:
    """(m, step seconds, busy seconds per micro-batch) of schedule `name` in a `sweep`, medians over the repeats."""
    runs = [[s for rec in run for s in rec["spans"]] for run in zip(*(rank[name, m] for rank in per_rank))]
    return (m, statistics.median(step_window(r) for r in runs),
            statistics.median(busy_per_microbatch(r, m) for r in runs))


def hop_of(per_rank: Sequence[Mapping[Any, Any]], name: str) -> float:
    """One message's cost, read off the m = 1 steps of schedule `name` in a `sweep` of p ranks: such a step is
    every stage's F in a row, then every B back, so its window is p (F + B) of work plus 2(p - 1) messages.
    hop = (window - p x busy per rank) / (2(p - 1)): everything a message adds (gloo's transfer, the
    receiver's wake-up, the runner's bookkeeping between two actions). Median over the steps. Never below 0:
    where a stage's span starts before its input has landed (the strict backend lets a receive return early, and
    `FixedCost` on a CPU has no stream to settle) the spans overlap and the difference can turn negative."""
    p = len(per_rank)
    if p < 2:
        raise ValueError("a hop needs at least 2 stages")
    _, window, busy = timing_of(per_rank, name, 1)
    return max(0.0, (window - p * busy) / (2 * (p - 1)))


def predicted_bubble(schedule: Schedule, p: int, m: int, cost: float, hop: float, gap: float = 0.0,
                     late: float | None = None) -> float:
    """The bubble of `schedule` when F costs `cost`, B 2 `cost`, a message `hop` seconds after its send (a
    receiver that comes after the send pays `late` after it gets there, default `hop`), sends wait for their
    receive (the runner's rendezvous) and a rank spends `gap` between two actions: the schedule simulated
    (`distlab.course.pipeline.simulate`), idle share of its window. With hop = gap = 0 it is
    (p - 1)/(m + p - 1) for GPipe and 1F1B."""
    from distlab.course.pipeline.simulate import simulate
    return bubble(simulate(schedule, p, m, t_f=cost, t_b=2 * cost, t_p2p=hop, rendezvous=True, t_gap=gap,
                           t_late=late))
