"""A pipeline schedule, simulated: when each action of each rank would run with given costs and no noise.

    spans = simulate(gpipe_order, p=3, m=4, t_f=1, t_b=2)     # [{"rank", "name", "start", "end", "kind"}, ...]
    makespan(spans)                                          # (m + p - 1)(t_f + t_b) = 18 for GPipe and 1F1B
    schedule_chart(spans, title=..., scale=1, xlabel="time (units)")   # the figure, from distlab.course.pipeline.plots

The charts of chapter 8 are drawn from this, not by hand. A schedule is a function
(p, m, r) -> rank r's actions in order: ("F", i), ("B", i) or ("W", i) for micro-batch i, and
("F", i, c) etc. for chunk c of an interleaved schedule (rank r then holds stages r, r + p, ...
of v p). Each action starts when its rank is free and its inputs exist:

- F of micro-batch i on stage s waits for F of i on stage s - 1 (its input activation);
- B of i on stage s waits for B of i on stage s + 1 (the gradient of its output) and F of i on s;
- W of i on s (the weight gradient of a split backward) waits for B of i on s.

A backward that is not split ("B" without a later "W" for that micro-batch) costs t_b + t_w; a split
one costs t_b, its W t_w. A chunk costs 1/v of each. `t_p2p` adds a message's latency to every
dependency that crosses ranks. The reference orders (`gpipe_order`, `one_f_one_b_order`,
`interleaved_order`) are the tables the lecture writes; the lab writes the first two as code.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

Action = tuple  # ("F" | "B" | "W", micro-batch[, chunk])


def gpipe_order(p: int, m: int, r: int) -> list[Action]:
    """GPipe on rank r: every forward, then every backward."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, r: int) -> list[Action]:
    """1F1B (PipeDream-Flush) on rank r: min(p - r - 1, m) warm-up forwards, then F and B in turn, then the rest."""
    w = min(p - r - 1, m)
    steady = [a for i in range(m - w) for a in (("F", w + i), ("B", i))]
    return [("F", i) for i in range(w)] + steady + [("B", i) for i in range(m - w, m)]


def interleaved_order(p: int, m: int, r: int, v: int = 2) -> list[Action]:
    """Megatron-LM's interleaved 1F1B on rank r with v chunks (needs m a multiple of p).

    Micro-batches go through the chunks in groups of p: forwards in the order (group, chunk, i),
    backwards the same with the chunks reversed; a warm-up of 2(p - r - 1) + (v - 1)p forwards
    (all of them if fewer), then one forward and one backward in turn, then the remaining backwards.
    """
    if m % p:
        raise ValueError(f"the interleaved schedule needs m a multiple of p: m={m}, p={p}")
    fwd = [("F", g * p + i, c) for g in range(m // p) for c in range(v) for i in range(p)]
    bwd = [("B", g * p + i, c) for g in range(m // p) for c in reversed(range(v)) for i in range(p)]
    w = min(2 * (p - r - 1) + (v - 1) * p, len(fwd))
    out = fwd[:w]
    for k in range(len(fwd) - w):
        out += [fwd[w + k], bwd[k]]
    return out + bwd[len(fwd) - w:]


def zero_bubble_order(p: int, m: int, r: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023) on rank r: 1F1B with each backward split into B (input gradient) and W
    (weight gradient). Rank r keeps up to r W's waiting: the later stages postpone their weight
    gradients so that B, which the earlier stages wait for, runs at once; the W's fill the cool-down.
    With t_f = t_b = t_w and m >= p its step matches `distlab.theory.pipeline.zero_bubble_fraction`."""
    w = min(p - r - 1, m)
    out: list[Action] = [("F", i) for i in range(w)]
    pending: list[int] = []
    for i in range(m):
        if w + i < m:
            out.append(("F", w + i))
        out.append(("B", i))
        pending.append(i)
        if len(pending) > r:
            out.append(("W", pending.pop(0)))
    return out + [("W", i) for i in pending]


def simulate(schedule: Callable[..., Sequence[Action]], p: int, m: int, *, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float = 0.0, v: int = 1, t_p2p: float = 0.0, rendezvous: bool = False,
             t_gap: float = 0.0, t_late: float | None = None,
             stage_of: Callable[[int, int], int] | None = None) -> list[dict[str, Any]]:
    """Spans {"rank", "name", "start", "end", "kind": "compute"} of every action, as `schedule` orders them.

    Names as on measured timelines: F<i>, B<i> (BW<i> for a backward that includes W), W<i>, with
    ".<chunk>" when v > 1. `t_p2p`: seconds a message between ranks takes. `rendezvous`: a send
    completes only once its receiver has posted the receive (gloo's point-to-point, and the
    course's runners, which wait for their sends before the next action): the sender's next action
    waits for that, and a message moves when both sides are there. `t_gap`: seconds a rank spends
    between two of its actions when it waits for nothing (the runner's bookkeeping). `t_late`: seconds from
    the moment a rank is free to the start of an action whose message was sent before it got there (default
    `t_p2p`, and nothing without `rendezvous`): gloo moves a message only once its receiver has posted the
    receive, so a receiver that comes late pays a round trip (its "ready" to the sender, the data back) where
    one already waiting pays one way, `t_p2p` after the send. `stage_of(r, c)`: the stage rank r's chunk c
    holds (default c p + r; ZBV's "V" places chunk 1 of rank r at 2p - 1 - r).
    Raises ValueError if the orders deadlock (an action waits for one that can never run), naming the rank and
    the action.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    orders = [[(a[0], a[1], a[2] if len(a) > 2 else 0) for a in schedule(p, m, r)] for r in range(p)]
    split = {(r, i, c) for r in range(p) for k, i, c in orders[r] if k == "W"}
    n = p * v
    place = stage_of or (lambda r, c: c * p + r)
    owner = {place(r, c): r for r in range(p) for c in range(v)}          # stage -> its rank
    if sorted(owner) != list(range(n)):
        raise ValueError(f"stage_of must place the {n} stages 0..{n - 1} on the ranks, one each")
    pos = {(r, k, i, place(r, c)): j for r in range(p) for j, (k, i, c) in enumerate(orders[r])}
    hop, gap, late = t_p2p, t_gap, t_p2p if t_late is None else t_late
    end: dict[tuple[str, int, int], float] = {}        # (kind, micro-batch, stage) -> end time
    ends: list[list[float]] = [[] for _ in range(p)]   # per rank, the end of each action run so far
    free, nxt, spans = [0.0] * p, [0] * p, []

    def consumer(kind: str, i: int, s: int) -> tuple[int, int] | None:
        """(rank, position) of the action that receives what (kind, i, stage s) sends, if on another rank."""
        t = s + 1 if kind == "F" else s - 1 if kind == "B" else -1
        if not 0 <= t < n or owner[t] == owner.get(s, s % p):
            return None
        return owner[t], pos.get((owner[t], kind, i, t))

    def posted(q: int, j: int) -> float | None:
        """When rank q posts the receive for its action j: when its previous action ended."""
        if j == 0:
            return 0.0
        return ends[q][j - 1] if len(ends[q]) >= j else None

    def ready(r: int, kind: str, i: int, c: int) -> float | None:
        s = place(r, c)
        start = free[r] + (gap if nxt[r] else 0.0)
        if rendezvous and nxt[r] > 0:                   # my last action's send must have been received
            pk, pi, pc = orders[r][nxt[r] - 1]
            to = consumer(pk, pi, place(r, pc))
            if to is not None and to[1] is not None:
                at = posted(*to)
                if at is None:
                    return None
                start = max(start, ends[r][-1] + hop, at + late)     # a late receiver: the round trip
        deps: list[tuple[str, int, int]] = []
        if kind == "F" and s > 0:
            deps.append(("F", i, s - 1))
        if kind == "B":
            deps.append(("F", i, s))
            if s < n - 1:
                deps.append(("B", i, s + 1))
        if kind == "W":
            deps.append(("B", i, s))
        for key in deps:
            if key not in end:
                return None
            remote = owner.get(key[2], key[2] % p) != r          # (a chunk out of range: as the default placement)
            if not remote:
                start = max(start, end[key])
            elif rendezvous:
                start = max(start, end[key] + hop, free[r] + late)
            elif t_late is not None:
                start = max(start, end[key] + hop, free[r] + late)
            else:
                start = max(start, end[key] + hop)
        return start

    total = sum(len(o) for o in orders)
    while len(spans) < total:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, i, c = orders[r][nxt[r]]
                start = ready(r, kind, i, c)
                if start is None:
                    break
                whole = kind == "B" and (r, i, c) not in split
                s = place(r, c)
                cost = {"F": t_f, "B": t_b + (t_w if whole else 0.0), "W": t_w}[kind] / v
                end[(kind, i, s)] = start + cost
                ends[r].append(start + cost)
                free[r] = start + cost
                name = ("BW" if whole and t_w else kind) + str(i) + (f".{s}" if v > 1 else "")
                spans.append({"rank": r, "name": name, "start": start, "end": start + cost, "kind": "compute"})
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])}
            raise ValueError(f"the schedule deadlocks: each rank's next action waits for one that never runs: {stuck}")
    return spans


def makespan(spans: Sequence[dict[str, Any]]) -> float:
    """From the first start to the last end."""
    return max(s["end"] for s in spans) - min(s["start"] for s in spans)
