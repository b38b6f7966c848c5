"""What a step adds on top of what a rank holds at rest: the peak of the memory meter beside the model states
(or the gradients) that remain. Each returns the matplotlib Figure (plots.py re-exports them).
"""
from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt

MB = 2 ** 20


def peak_and_kept(labels: Sequence[str], peaks: Sequence[float], kept: Sequence[float], *, title: str,
                  line: tuple[float, str] | None = None, unit: float = MB) -> plt.Figure:
    """Horizontal bars per run: what backward allocated at its peak (grey) with what stays after it drawn
    over it (red); `line`: (bytes, label) of a theory level, e.g. one full gradient."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(labels, [p / unit for p in peaks], color="#bbb", label="peak during backward (measured)")
    ax.barh(labels, [k / unit for k in kept], color="#c64", label="gradient bytes kept (measured)")
    if line is not None:
        ax.axvline(line[0] / unit, color="k", ls="--", label=line[1])
    ax.set_xlabel("MiB (rank 0)" if unit == MB else f"x{unit:g} bytes (rank 0)")
    ax.set_xlim(left=0)
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def peak_over_rest(labels: Sequence[str], rest: Sequence[float], peaks: Sequence[float], theory: Sequence[float], *,
                   title: str, theory_label: str = "theory", unit: float = 1e6) -> plt.Figure:
    """One bar per run: the model states at rest (green) with the part of the peak above them (grey) stacked on
    top, and a black tick at each run's theory of the resting part (e.g. 16 Psi/N)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(labels))
    base = [r / unit for r in rest]
    ax.bar(xs, base, 0.5, color="#55A868", label="model states at rest (measured)")
    ax.bar(xs, [(p - r) / unit for r, p in zip(rest, peaks)], 0.5, bottom=base, color="#BBBBBB",
           label="peak − rest: gathered units + activations (measured)")
    ax.plot(xs, [t / unit for t in theory], "k_", ms=40, mew=2, label=theory_label)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("MB per rank" if unit == 1e6 else f"x{unit:g} bytes per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
