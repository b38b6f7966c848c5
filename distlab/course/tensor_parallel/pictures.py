"""Chapter 7's diagrams, drawn from the layouts themselves (no measurement): who holds which part of what.

    from distlab.course.tensor_parallel.pictures import causal_pairs, linear_splits, ulysses_layouts
    linear_splits(t=4)          # nn.Linear's weight (out, in): column-parallel cuts rows, row-parallel columns
    ulysses_layouts(cp=4)       # Ulysses' all-to-all: tokens x heads, from sequence shards to head shards
    causal_pairs(cp=4)          # which rank computes each (query block, key block) pair: plain ring vs zig-zag

Each returns the matplotlib Figure (the notebook shows it).
"""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap


def _ranks_cmap(n: int) -> ListedColormap:
    return ListedColormap([plt.get_cmap("tab10")(i) for i in range(n)])


def _grid(ax: Any, owner: np.ndarray, n: int, title: str, xlabel: str, ylabel: str) -> None:
    masked = np.ma.masked_less(owner, 0)
    ax.imshow(masked, cmap=_ranks_cmap(n), vmin=-0.5, vmax=n - 0.5, aspect="auto")
    for (i, j), r in np.ndenumerate(owner):
        if r >= 0:
            ax.text(j, i, str(r), ha="center", va="center", fontsize=7, color="white")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def linear_splits(t: int = 4, out_features: int = 8, in_features: int = 8) -> Any:
    """`nn.Linear(in, out)`'s weight W, shape (out, in), as t ranks hold it: column-parallel (Megatron's "split A = W^T
    by columns") keeps rows of W and computes out/t output features; row-parallel keeps columns of W, takes in/t
    input features, and leaves a partial sum of every output feature."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    col = np.repeat(np.arange(t), out_features // t)[:, None].repeat(in_features, 1)
    row = np.repeat(np.arange(t), in_features // t)[None, :].repeat(out_features, 0)
    _grid(axes[0], col, t, f"column-parallel: weight.chunk({t}, dim=0)\nrank r: ({out_features // t}, {in_features}), "
          f"bias chunk r; x whole -> y[..., chunk r]", f"in_features = {in_features}", f"out_features = {out_features}")
    _grid(axes[1], row, t, f"row-parallel: weight.chunk({t}, dim=1)\nrank r: ({out_features}, {in_features // t}), "
          "bias whole; x[..., chunk r] -> partial y", f"in_features = {in_features}", f"out_features = {out_features}")
    fig.suptitle("nn.Linear stores W as (out_features, in_features) and computes x W^T + b; colour = rank",
                 fontsize=10)
    fig.tight_layout()
    return fig


def ulysses_layouts(cp: int = 4, heads: int = 8, seq_blocks: int | None = None) -> Any:
    """Who holds which (token block, head) of Q, K, V: before the all-to-all each rank has its S/cp tokens and
    every head; after it, every token and its a/cp heads. Rank r sends the piece (its tokens, head group j)
    to rank j: (cp-1)/cp of its block leaves it."""
    seq_blocks = seq_blocks or cp
    per = seq_blocks // cp
    before = np.repeat(np.arange(cp), per)[:, None].repeat(heads, 1)
    after = np.repeat(np.arange(cp), heads // cp)[None, :].repeat(seq_blocks, 0)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    _grid(axes[0], before, cp, "sequence layout: rank r holds (B, a, S/cp, hd)", f"heads (a = {heads})",
          f"tokens, in {seq_blocks} blocks")
    _grid(axes[1], after, cp, "head layout: rank r holds (B, a/cp, S, hd)", f"heads (a = {heads})",
          f"tokens, in {seq_blocks} blocks")
    for i in range(cp):                              # the piece rank 0 keeps and the ones it sends
        axes[0].add_patch(plt.Rectangle((i * heads // cp - 0.5, -0.5), heads // cp, per, fill=False, lw=1.5,
                                        ls="-" if i == 0 else "--", ec="black"))
    axes[0].annotate("", xy=(1.12, 0.5), xytext=(1.0, 0.5), xycoords="axes fraction",
                     arrowprops=dict(arrowstyle="->", lw=2))
    fig.text(0.5, 0.04, "all-to-all: rank r's box j (its tokens, head group j) goes to rank j; "
             "the reverse all-to-all brings attention's output back", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def causal_pairs(cp: int = 4) -> Any:
    """The causal (query block, key block) pairs of a sequence cut into 2cp blocks, coloured by the rank that
    computes each: a plain ring (rank r holds blocks 2r, 2r+1) against zig-zag (blocks r and 2cp-1-r). Pairs
    above the diagonal are masked out and never computed; the count per rank is the work."""
    n = 2 * cp
    plain_owner = [b // 2 for b in range(n)]
    zig_owner = [min(b, n - 1 - b) for b in range(n)]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, owner, name in ((axes[0], plain_owner, "plain ring: rank r holds blocks 2r, 2r+1"),
                            (axes[1], zig_owner, "zig-zag: rank r holds blocks r and 2cp-1-r")):
        grid = np.array([[owner[i] if j <= i else -1 for j in range(n)] for i in range(n)])
        counts = [int((grid == r).sum()) for r in range(cp)]
        _grid(ax, grid, cp, f"{name}\nblock pairs per rank: {counts}", "key block", "query block")
    fig.tight_layout()
    return fig
