"""Line plots the lectures draw from measured records: a quantity against steps or a swept size, theory as a
dotted level beside it. Each returns the matplotlib Figure (plots.py re-exports them).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt


def loss_curves(reference: Sequence[float], curves: Mapping[str, Sequence[float]], *, title: str,
                reference_label: str = "1 process (reference)", ylabel: str = "loss (full batch)") -> plt.Figure:
    """Loss per step: the single-process reference as a wide grey line, each distributed run dashed on top,
    so that curves which coincide look like one."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(reference, "-", lw=3, color="#bbb", label=reference_label)
    for (label, losses), style in zip(curves.items(), ["--", ":", "-.", (0, (5, 1))] * 4):
        ax.plot(losses, linestyle=style, lw=2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def measured_curve(xs: Sequence[float], ys: Sequence[float], *, xlabel: str, ylabel: str, title: str,
                   reference: tuple[float, str] | None = None, log_base: int = 2) -> plt.Figure:
    """One measured quantity against a swept size on a log x axis (throughput vs batch, time vs bucket
    count), from zero up; `reference`: (value, label) of a level drawn dotted, e.g. the one-bucket time."""
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(xs, ys, "o-", color="#36a", label="measured")
    if reference is not None:
        ax.plot(xs, [reference[0]] * len(xs), "k:", label=reference[1])
    ax.set_xscale("log", base=log_base)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def activation_growth(rows: Sequence[int], held: Sequence[float], peaks: Sequence[float], *, held_theory: float,
                      held_theory_label: str, title: str, unit: float = 1e6) -> plt.Figure:
    """Per rows-per-rank: the peak during a step minus the bytes held before it (the activations, and what
    backward brings back), the bytes held before it, and the theory of the latter as a dotted level."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(rows, [(p - h) / unit for h, p in zip(held, peaks)], "o-",
            label="peak during a step − bytes held before it (measured)")
    ax.plot(rows, [h / unit for h in held], "s", color="gray",
            label="held before a step, after zero_grad(set_to_none=True) (measured)")
    ax.axhline(held_theory / unit, color="black", ls=":", label=held_theory_label)
    ax.set(xlabel="rows per rank (B/N)", ylabel="MB per rank" if unit == 1e6 else f"x{unit:g} bytes per rank",
           ylim=(0, None), title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def measured_and_theory(series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]], *,
                        xlabel: str, ylabel: str, title: str, unit: float = 1.0) -> plt.Figure:
    """One colour per series {label: (xs, measured, theory)}: the closed form as a line, the measured values as
    dots on it (e.g. activations kept for backward against S, one series per recomputation mode)."""
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    for i, (label, (xs, measured, theory)) in enumerate(series.items()):
        suffix = f", {label}" if label else ""
        ax.plot(xs, [t / unit for t in theory], "-", color=f"C{i}", alpha=0.6, label=f"theory{suffix}")
        ax.plot(xs, [m / unit for m in measured], "o", color=f"C{i}", label=f"measured{suffix}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
