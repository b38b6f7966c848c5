"""The bubble read off a pipeline's timeline (`distlab.meters.Timeline` spans, or their dicts): each rank's idle
share of one step's window, their mean (the measured bubble), and the idle time per slot fitted across m.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping


def _rows(spans: Iterable[Any]) -> list[Mapping[str, Any]]:
    return [s if isinstance(s, Mapping) else s.__dict__ for s in spans]


def _compute_rows(spans: Iterable[Any]) -> list[Mapping[str, Any]]:
    rows = [r for r in _rows(spans) if r["kind"] == "compute"]
    if not rows:
        raise ValueError("no compute spans")
    return rows


def _busy(rows: list[Mapping[str, Any]]) -> dict[int, float]:
    """Per rank, in rank order: seconds inside compute spans."""
    busy: dict[int, float] = {}
    for r in rows:
        busy[r["rank"]] = busy.get(r["rank"], 0.0) + (r["end"] - r["start"])
    return dict(sorted(busy.items()))


def step_window(spans: Iterable[Any]) -> float:
    """Seconds from the first compute span's start to the last one's end, over all ranks: one step."""
    rows = _compute_rows(spans)
    return max(r["end"] for r in rows) - min(r["start"] for r in rows)


def idle_fractions(spans: Iterable[Any]) -> dict[int, float]:
    """Per rank: the share of the step window (`step_window`) it spent outside compute spans.
    Waiting for a message counts as idle."""
    rows = _compute_rows(spans)
    window = step_window(rows)
    return {k: 1.0 - v / window for k, v in _busy(rows).items()}


def bubble(spans: Iterable[Any]) -> float:
    """The measured bubble fraction: the ranks' mean idle share of the step window."""
    return statistics.fmean(idle_fractions(spans).values())


def busy_per_microbatch(spans: Iterable[Any], m: int) -> float:
    """Seconds of compute per micro-batch, averaged over ranks: each rank's forward + backward of one
    micro-batch as it really ran (sleeps included, and whatever stretched them)."""
    return statistics.fmean(_busy(_compute_rows(spans)).values()) / m


def slot_overhead(steps: Iterable[tuple[int, float, float]], p: int) -> float:
    """Fit T(m) = (m + p - 1)(s_m + o) to measured (m, step seconds T, busy seconds per micro-batch s_m):
    the idle time o each of the m + p - 1 slots adds beyond its work (messages, waking up). Least squares."""
    rows = [(m + p - 1, t, s) for m, t, s in steps]
    if not rows:
        raise ValueError("no steps to fit")
    return sum(k * (t - k * s) for k, t, s in rows) / sum(k * k for k, _, _ in rows)


def bubble_with_overhead(p: int, m: int, overhead_s: float, slot_s: float) -> float:
    """Idle share when each of the m + p - 1 slots takes slot_s of work plus overhead_s of waiting,
    and a rank works m of them: 1 - m slot_s / ((m + p - 1)(slot_s + overhead_s))."""
    return 1.0 - m * slot_s / ((m + p - 1) * (slot_s + overhead_s))
