"""Chapter 8, section 7: the harness around `torch.distributed.pipelining` (the lecture builds the stages and
the schedule itself; these functions time its calls and read its table).

    pstage = timed(PipelineStage(FixedCost(stage, c, c, c), index, n, device), timeline)
    out = run_steps(schedule, stages, chunks, timeline, args=(x,), kwargs={}, repeats=3)
    order, stage_of = torch_order(per_rank, "ScheduleInterleaved1F1B")   # PyTorch's own table, for `simulate`

What crosses the wire is PyTorch's: one activation forward and one gradient back per micro-batch and chunk
boundary, sent by its `PipelineStage`s; `track_comm` counts them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist

from distlab.engine import runtime as rt
from distlab.meters import Timeline, track_comm


def timed(pstage: Any, timeline: Timeline) -> Any:
    """`pstage` (a `PipelineStage`) with each forward, backward and weight-gradient call recorded on `timeline`
    as a span F<i>.<stage>, B<i>.<stage> (BW<i> for a whole backward) or W<i>.<stage>. Returns `pstage`."""
    label = pstage.stage_index
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        original = getattr(pstage, method)

        def wrapped(i: int, *args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
            if _kind == "B" and kwargs.get("full_backward", True):
                _kind = "BW"                                # a whole backward: B and W at once
            with timeline.span(f"{_kind}{i}.{label}"):
                return _original(i, *args, **kwargs)
        setattr(pstage, method, wrapped)
    return pstage


def run_steps(schedule: Any, stages: Sequence[Any], chunks: Sequence[int], timeline: Timeline, *,
              args: tuple = (), kwargs: Mapping[str, Any] | None = None, repeats: int = 1) -> dict[str, Any]:
    """One untimed `schedule.step(*args, **kwargs)` (the stages infer their neighbours' shapes there), then
    `repeats` timed ones, each after a barrier. `stages`: the course `Stage`s this rank holds, `chunks` their
    indices. Returns `steps` (per timed step, this rank's spans), `spans` (the first's), the mean `loss` of
    the last step (on the rank with the last stage; None elsewhere), `comm` (the first timed step's sends),
    `grads` under their names in the whole model, `chunks`, and `order`: this rank's actions as PyTorch's
    table lists them, ("F" | "B" | "W", micro-batch, chunk) with chunk an index into `chunks` (None for the
    single-stage schedules, which run without a table)."""
    kwargs = dict(kwargs or {})
    losses = kwargs.get("losses")
    schedule.step(*args, **kwargs)
    steps, comm = [], None
    for _ in range(repeats):
        for st in stages:
            st.zero_grad(set_to_none=True)
        timeline.finish().clear()                            # (on GPUs, finish() reads the CUDA events)
        if losses is not None:
            losses.clear()
        dist.barrier()
        with track_comm() as meter:
            schedule.step(*args, **kwargs)
        steps.append(list(timeline.finish()))
        comm = comm or meter.stats()
    table = getattr(schedule, "pipeline_order", None)
    r = rt.rank()
    order = None if not table else [({"I": "B"}.get(a.computation_type.value, a.computation_type.value),
                                     a.microbatch_index, list(chunks).index(a.stage_index))
                                    for a in table[r] if a is not None]
    m = schedule._n_microbatches
    return {"steps": steps, "spans": steps[0], "loss": sum(float(v.detach()) for v in losses) / m if losses else None,
            "comm": comm, "chunks": list(chunks), "order": order,
            "grads": {st.full_names[k]: q.grad for st in stages for k, q in st.named_parameters()}}


def torch_order(per_rank: Sequence[Mapping[str, Any]]) -> tuple[Callable[..., list], Callable[[int, int], int]]:
    """PyTorch's own table from the ranks' `run_steps` results, for `simulate`: the schedule (p, m, r) -> rank
    r's actions, and `stage_of(r, c)` -> the stage of rank r's chunk c (ZBV's "V")."""
    orders = [rank["order"] for rank in per_rank]
    chunks = [rank["chunks"] for rank in per_rank]
    if any(o is None for o in orders):
        raise ValueError("this schedule runs without a table: simulate the lecture's own order instead")
    return (lambda p, m, r: orders[r]), (lambda r, c: chunks[r][c])
