"""Figures of chapter 8: pipeline schedules as measured, bubble vs micro-batches, activations per rank, the
spread of single steps around a model.

Each takes measured spans or numbers (with theory beside them, labelled) and returns the Figure.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import matplotlib.pyplot as plt

# Forward light, backward dark; a zero-bubble schedule's weight-gradient pass in orange.
PHASE_COLORS = {"F": "#9ecae1", "B": "#3182bd", "BW": "#3182bd", "W": "#fd8d3c"}


def _rows(spans: Iterable[Any]) -> list[Mapping[str, Any]]:
    return [s if isinstance(s, Mapping) else s.__dict__ for s in spans]


def _phase(name: str) -> tuple[str, str]:
    """'F3' -> ('F', '3'); 'BW2.5' -> ('BW', '2.5')."""
    i = next((k for k, ch in enumerate(name) if ch.isdigit()), len(name))
    return name[:i], name[i:]


def schedule_chart(spans: Iterable[Any], *, title: str, ax: Any = None, scale: float = 1e3,
                   xlabel: str = "time (ms)") -> Any:
    """One row per rank; each compute span a box labelled with its micro-batch (and chunk).

    Span names are `F<k>` (forward), `B<k>` (backward; `BW<k>` a full one), `W<k>` (weight
    gradient), optionally `.<chunk>`; idle time stays white: the bubble. Times are multiplied by
    `scale` (seconds -> ms by default; 1 with `xlabel="time (units)"` for a simulated schedule,
    `distlab.course.pipeline.simulate`).
    """
    rows = [r for r in _rows(spans) if r["kind"] == "compute"]
    if not rows:
        raise ValueError("no compute spans to draw")
    t0 = min(r["start"] for r in rows)
    ranks = sorted({r["rank"] for r in rows})
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(9, 0.55 * len(ranks) + 1.1))
    for r in rows:
        phase, label = _phase(r["name"])
        y = ranks.index(r["rank"])
        left, width = (r["start"] - t0) * scale, (r["end"] - r["start"]) * scale
        ax.barh(y, width, left=left, height=0.8, color=PHASE_COLORS.get(phase, "#999999"),
                edgecolor="white", linewidth=0.5)
        ax.text(left + width / 2, y, label.split(".")[0], ha="center", va="center", fontsize=6,
                color="white" if phase in ("B", "BW") else "black")
    ax.set_yticks(range(len(ranks)), [f"rank {k}" for k in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    if own:
        fig.tight_layout()
        return fig
    return ax


def bubble_vs_m(measured: Mapping[str, Sequence[tuple[int, float]]], theory: Any, *, stages: Sequence[int],
                title: str, with_overhead: Mapping[int, Any] | None = None,
                overhead_label: str = "theory + fitted overhead per slot") -> Any:
    """Measured bubble fraction (points, one series per label) vs m, with (p-1)/(m+p-1) as lines;
    `with_overhead[p]`: m -> a model's bubble with what the formula leaves out (dashed), labelled
    `overhead_label` (say whether it was fitted to these points or measured apart)."""
    fig, ax = plt.subplots(figsize=(5.8, 3.7))
    ms = sorted({m for pts in measured.values() for m, _ in pts})
    grid = list(range(1, max(ms) + 1))
    for p in stages:
        shade = 0.35 + 0.15 * list(stages).index(p)
        ax.plot(grid, [theory(p, m) for m in grid], "-", color="black", alpha=shade,
                label=f"theory (p-1)/(m+p-1), p={p}")
        if with_overhead and p in with_overhead:
            ax.plot(grid, [with_overhead[p](m) for m in grid], "--", color="black", alpha=shade,
                    label=f"{overhead_label}, p={p}")
    markers = "os^vD"
    for i, (label, pts) in enumerate(measured.items()):
        pts = sorted(pts)
        ax.plot([m for m, _ in pts], [b for _, b in pts], markers[i % len(markers)], ms=6, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share of the step)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def activations_by_rank(measured: Mapping[str, Sequence[float]], predicted: Mapping[str, Sequence[float]], *,
                        title: str) -> Any:
    """Peak activations per rank in micro-batches: bars measured, black ticks theory."""
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    names = list(measured)
    ranks = len(next(iter(measured.values())))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [r + (j - (len(names) - 1) / 2) * width for r in range(ranks)]
        ax.bar(xs, measured[name], width, label=f"{name} (measured)")
        ax.scatter(xs, predicted[name], marker="_", s=400, color="black", zorder=3,
                   label="theory" if j == 0 else None)
    ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylabel("micro-batches of activations held")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def ratio_spread(ratios: Mapping[str, Sequence[float]], *, title: str, band: float = 0.05) -> Any:
    """Each step's measured / model ratio (dots, one row per point), the median of each row (a bar), 1 and the
    ±`band` around it (grey): how far single steps stray from the model, and in which direction."""
    labels = list(ratios)
    fig, ax = plt.subplots(figsize=(7.0, 0.28 * len(labels) + 1.3))
    ax.axvspan(1 - band, 1 + band, color="#dddddd", zorder=0, label=f"model ± {band:.0%}")
    ax.axvline(1, color="black", lw=0.8)
    for y, label in enumerate(labels):
        xs = sorted(ratios[label])
        ax.scatter(xs, [y] * len(xs), s=14, color="#3182bd", alpha=0.7, zorder=2)
        mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
        ax.plot([mid, mid], [y - 0.35, y + 0.35], color="#d62728", lw=2, zorder=3)
    ax.plot([], [], color="#d62728", lw=2, label="median of the steps")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / model, one dot per timed step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
