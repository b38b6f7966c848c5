"""The lab solution's finer model of the runner's bubble: the hop, the late receiver and the gap read off a
`sweep`'s own steps (`solutions/08_pipeline.ipynb` uses it beside `runner.predicted_bubble`).

The lecture no longer uses it: it compares the bubble with (p - 1)/(m + p - 1) and with the schedule simulated
with one hop cost (`runner.hop_of`), and says in prose what a loaded CPU adds.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

from distlab.course.pipeline.runner import Schedule
from distlab.course.pipeline.bubble import _rows


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
    action of a kind: the sweep point's own costs, its ranks, its load, its kinds of wait."""
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
