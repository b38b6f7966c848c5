"""Chapter 3's precision figure: the measured error of a gradient reduction against N, theory beside it."""
from __future__ import annotations

from typing import Sequence

import torch


def reduction_error_figure(ns: Sequence[int], measured: dict, *, title: str = "") -> None:
    """`measured[(kind, dtype_name)]`: one relative error per n in `ns` (kind: 'all_reduce' or
    'reduce_scatter'; dtype_name: 'bfloat16' or 'float32'). Draws the points, the RMS model of
    `distlab.theory.precision` (solid) and the one-sign worst case N·u (dashed), per reduce dtype, log y."""
    import matplotlib.pyplot as plt

    from distlab.theory.precision import reduction_error_bound, reduction_error_rms
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    grid = list(range(min(ns), max(ns) + 1))
    for name, color in (("bfloat16", "#c64"), ("float32", "#27a")):
        dtype = getattr(torch, name)
        ax.plot(grid, [reduction_error_rms(n, dtype) for n in grid], color=color, label=f"{name}: RMS model")
        ax.plot(grid, [reduction_error_bound(n, dtype) for n in grid], color=color, ls="--", lw=1,
                label=f"{name}: one-sign bound N·u")
        for kind, marker in (("all_reduce", "o"), ("reduce_scatter", "s")):
            got = measured.get((kind, name))
            if got is not None:
                ax.plot(ns, [max(e, 1e-12) for e in got], marker, color=color, mfc="none" if kind == "reduce_scatter"
                        else color, label=f"{name}: {kind.replace('_', '-')}, measured")
    ax.set(xscale="log", yscale="log", xlabel="N (ranks)", ylabel="||reduced - exact|| / ||exact||", title=title)
    ax.set_xticks(list(ns), [str(n) for n in ns])
    ax.minorticks_off()
    ax.legend(fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    plt.show()
