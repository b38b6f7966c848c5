"""Chapter 10's pictures, drawn from routing decisions and measured counts (the notebook passes them in).

    token_flow(expert, slot, ranks=2, n_experts=4)   # tokens on their ranks -> the experts they chose, across ranks
    splits(m)                                         # the all-to-all's send and receive splits: rows i -> j
    load_over_steps(runs)                             # tokens per expert and per rank over steps, busiest rank

Each returns the matplotlib Figure.
"""
from __future__ import annotations

from typing import Any, Sequence

import matplotlib.pyplot as plt
import numpy as np


def _colour(r: int) -> Any:
    return plt.get_cmap("tab10")(r % 10)


def token_flow(expert: Any, slot: Any, ranks: int, n_experts: int, title: str = "") -> Any:
    """Tokens (left, grouped by the rank that holds them) to experts (right, grouped by the rank that holds
    them): a solid line per kept (token, choice), thicker for the first choice; a dotted grey one per dropped
    assignment. `expert`, `slot`: (T, k) from `route` on all ranks' tokens, rank r's tokens the r-th block."""
    expert, slot = np.asarray(expert), np.asarray(slot)
    t, k = expert.shape
    per_rank, per_e = t // ranks, n_experts // ranks
    fig, ax = plt.subplots(figsize=(7, 0.22 * max(t, 2 * n_experts) + 1.2))
    ty = np.linspace(1, 0, t)
    ey = np.linspace(0.95, 0.05, n_experts)
    crossing = 0
    for i in range(t):
        for c in range(k):
            e = int(expert[i, c])
            remote = e // per_e != i // per_rank
            if slot[i, c] < 0:
                ax.plot([0, 1], [ty[i], ey[e]], ls=":", color="0.6", lw=0.8)
                continue
            crossing += remote
            ax.plot([0, 1], [ty[i], ey[e]], color=_colour(i // per_rank), lw=1.8 if c == 0 else 0.8,
                    alpha=0.9 if remote else 0.45)
    for i in range(t):
        ax.scatter(0, ty[i], s=30, color=_colour(i // per_rank), zorder=3)
    for e in range(n_experts):
        ax.scatter(1, ey[e], s=140, marker="s", color=_colour(e // per_e), zorder=3)
        ax.text(1.04, ey[e], f"expert {e} (rank {e // per_e})", va="center", fontsize=8)
    for r in range(ranks):
        ax.text(-0.04, ty[r * per_rank: (r + 1) * per_rank].mean(), f"rank {r}'s\ntokens", ha="right",
                va="center", fontsize=8, color=_colour(r))
    kept = int((slot >= 0).sum())
    ax.set_title(title or f"{t} tokens, top-{k}: {kept} kept assignments, {crossing} of them cross to another "
                 f"rank; {t * k - kept} dropped (dotted)", fontsize=9)
    ax.set_xlim(-0.35, 1.45)
    ax.axis("off")
    fig.tight_layout()
    return fig


def splits(m: Sequence[Sequence[int]], row_bytes: int | None = None) -> Any:
    """The all-to-all as a matrix (left: M[i][j], the rows rank i sends to rank j; the diagonal stays home)
    and per rank (right): rank i's input splits are its row, its output splits its column."""
    m = np.asarray(m)
    n = len(m)
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2), gridspec_kw={"width_ratios": [1, 1.4]})
    ax = axes[0]
    ax.imshow(m, cmap="Blues", vmin=0)
    for (i, j), c in np.ndenumerate(m):
        ax.text(j, i, str(c), ha="center", va="center", fontsize=9,
                color="white" if c > m.max() / 2 else "black", fontweight="bold" if i == j else None)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to rank j (output_split_sizes on j)", fontsize=8)
    ax.set_ylabel("from rank i (input_split_sizes on i)", fontsize=8)
    ax.set_title("rows sent i -> j", fontsize=9)
    ax = axes[1]
    width = 0.38
    for i in range(n):
        left_s = left_r = 0
        for j in range(n):
            hatch = "//" if i == j else None
            ax.barh(i - width / 2, m[i, j], width, left=left_s, color=_colour(j), hatch=hatch, ec="white")
            ax.barh(i + width / 2, m[j, i], width, left=left_r, color=_colour(j), hatch=hatch, ec="white",
                    alpha=0.55)
            left_s += m[i, j]
            left_r += m[j, i]
        sent = m[i].sum() - m[i, i]
        extra = f" = {sent * row_bytes} B" if row_bytes else ""
        ax.text(max(left_s, left_r) + 0.5, i, f"sends {sent} rows{extra}", va="center", fontsize=8)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {i}" for i in range(n)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("rows (upper bar: what the rank sends, by destination; lower: what it receives, by source; "
                  "hatched: its own)", fontsize=7)
    ax.set_xlim(0, m.sum(1).max() * 1.6 + 1)
    ax.set_title("uneven splits per rank", fontsize=9)
    fig.tight_layout()
    return fig


def load_over_steps(runs: dict[str, Any], ranks: int) -> Any:
    """For each run (name -> an object with `busiest_expert()` and `busiest_rank(ep)`, per step, as
    `distlab.course.moe.measure.Loads` has): the busiest expert's rows (left) and the busiest rank's (right)
    against a balanced share, over the steps; the step waits for the busiest rank."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, run in runs.items():
        expert, rank = np.asarray(run.busiest_expert()), np.asarray(run.busiest_rank(ranks))
        axes[0].plot(expert, label=name)
        axes[1].plot(rank, label=f"{name}: {rank[-max(len(rank) // 3, 1):].mean():.2f} over the last third")
    for ax, what in ((axes[0], "busiest expert's rows / a balanced share (T k / E)"),
                     (axes[1], f"busiest of ep = {ranks} ranks / a balanced share (T k / ep)")):
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_title(what, fontsize=9)
        ax.set_xlabel("training step", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def load_heatmaps(runs: dict[str, Any], ranks: int) -> Any:
    """For each run (name -> an object with `kept`, (steps, E) rows per expert): the rows each expert computed
    at every step as a heatmap (experts grouped by rank, white lines between ranks), one panel per run,
    on one colour scale."""
    kept = {name: np.asarray(run.kept, dtype=float) for name, run in runs.items()}
    top = max(k.max() for k in kept.values())
    fig, axes = plt.subplots(1, len(kept), figsize=(3.2 * len(kept), 3.0), sharey=True, squeeze=False)
    for ax, (name, k) in zip(axes[0], kept.items()):
        im = ax.imshow(k, aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        per = k.shape[1] // ranks
        for r in range(1, ranks):
            ax.axvline(r * per - 0.5, color="white", lw=1.5)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(f"expert (ranks of {per} experts)", fontsize=8)
    axes[0][0].set_ylabel("training step", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.85, label="rows computed")
    return fig
