"""The figures every chapter reuses. Each draws measured values, with theory beside them, labelled.

All functions take plain records (dicts or meter dataclasses) and return the
matplotlib Figure, so a notebook shows it and the tour saves it.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import matplotlib.pyplot as plt

from distlab.viz.curves import activation_growth, loss_curves, measured_and_theory, measured_curve  # noqa: F401 - lectures import them here
from distlab.viz.peaks import peak_and_kept, peak_over_rest  # noqa: F401 - lectures import them here

COMPONENT_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer_state": "#55A868", "other": "#8C8C8C",
                    "total": "#C7C7C7"}  # "total": a prediction given without a split
# memory_bars also takes the optimizer states split by key (fp32 master copy, Adam's m and v), stacked in this order
_STACK_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "master": "#2E7D4F", "exp_avg": "#55A868",
                 "exp_avg_sq": "#9FD3A8", **{k: v for k, v in COMPONENT_COLORS.items() if k not in ("params", "grads")}}
KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452"}
MB = 2 ** 20


def memory_bars(measured: Sequence[Mapping[str, float]], labels: Sequence[str],
                predicted: Sequence[Mapping[str, float]] | None = None, *,
                title: str = "Model-state memory per rank", unit: float = MB,
                line: tuple[float, str] | None = None) -> plt.Figure:
    """Stacked bars per component, measured (solid) beside predicted (hatched).

    `measured[i]` / `predicted[i]`: {component: bytes} for bar group `labels[i]`; `line`: (bytes, label) of a
    theory level drawn dotted across the bars (e.g. 16 Psi, or ZeRO-1's floor 4 Psi).
    """
    fig, ax = plt.subplots(figsize=(min(14, max(6, 1.1 * len(labels) + 2)), 4.2))
    width = 0.38 if predicted else 0.6
    components = [c for c in _STACK_COLORS if any(c in m for m in list(measured) + list(predicted or []))]
    for j, series in enumerate([measured] + ([predicted] if predicted else [])):
        bottom = [0.0] * len(labels)
        xs = [i + (j - 0.5) * width if predicted else i for i in range(len(labels))]
        for comp in components:
            vals = [s.get(comp, 0) / unit for s in series]
            ax.bar(xs, vals, width, bottom=bottom, color=_STACK_COLORS[comp],
                   hatch="//" if j else None, edgecolor="white" if not j else "black", linewidth=0.5,
                   label=comp.replace("_", " ") if (j == 0 or comp == "total") and any(vals) else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=30 if len(labels) > 5 else 0,
                  ha="right" if len(labels) > 5 else "center")
    if line is not None:
        ax.axhline(line[0] / unit, color="k", ls=":", lw=1, label=line[1])
    ax.set_ylim(bottom=0)
    ax.set_ylabel("MiB per rank" if unit == MB else f"x{unit:g} bytes")
    ax.set_title(title + ("  (solid: measured, hatched: theory)" if predicted else ""), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def value_bars(values: Mapping[str, float], *, ylabel: str, title: str,
               predicted: Mapping[str, float] | None = None) -> plt.Figure:
    """One bar per implementation (throughput, bytes, ...), theory as a marker where given."""
    names = list(values)
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(names) + 2), 3.2))
    ax.bar(names, [values[n] for n in names], color="#4C72B0", label="measured")
    if predicted:
        xs = [i for i, n in enumerate(names) if n in predicted]
        ax.scatter(xs, [predicted[names[i]] for i in xs], marker="_", s=900, color="black",
                   zorder=3, label="theory")
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    return fig


def busbw_sweep(records: Iterable[Mapping[str, Any]], *, title: str = "Bus bandwidth vs message size",
                metric: str = "busbw_GBps", fit: Mapping[str, float] | None = None) -> plt.Figure:
    """busbw (or algbw) vs bytes on log axes, one line per (op, impl).

    `fit`: an alpha-beta fit of the all-reduce times (world_size, alpha_s, beta_Bps, s_star_bytes, as the
    `collectives_fit` record holds it): the latency-bound side S < S* is shaded, and on a busbw plot the
    fitted model T = 2(N-1) alpha + 2(N-1)/N S / beta is drawn dotted beside the measured points.
    """
    records = list(records)
    lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in records:
        lines.setdefault((r["op"], r["impl"]), []).append((r["bytes"], r[metric]))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (op, impl), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                linestyle="-" if impl == "library" else "--", label=f"{op} ({impl})")
    if fit is not None:
        _draw_alpha_beta_fit(ax, sorted({r["bytes"] for r in records}), fit, model=metric == "busbw_GBps")
    ax.set_xscale("log", base=2)
    if any(y > 0 for pts in lines.values() for _, y in pts):
        ax.set_yscale("log")
    else:       # one rank: busbw = algbw x 2(N-1)/N is 0 for every implementation (nothing crosses a wire)
        title += " (busbw is 0 on one rank)"
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel(metric.replace("_GBps", " (GB/s)"))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _draw_alpha_beta_fit(ax: plt.Axes, sizes: Sequence[float], fit: Mapping[str, float], *, model: bool) -> None:
    """Shade S < S* and, where `model`, draw the fitted all-reduce busbw (theory.busbw of the model's time)."""
    from distlab import theory
    n = int(fit["world_size"])
    ax.axvspan(sizes[0] / 2, fit["s_star_bytes"], color="grey", alpha=0.15, label="latency-bound (S < S*)")
    if model:
        a = max(2 * (n - 1), 1) * fit["alpha_s"]              # the fit's intercept: 2(N-1) steps of alpha
        b = max(2 * (n - 1) / n, 1e-12) / fit["beta_Bps"]     # its slope: 2(N-1)/N bytes per byte, at beta
        ax.plot(sizes, [theory.busbw("all_reduce", s, a + b * s, n) / 1e9 for s in sizes], "k:", lw=1,
                label="alpha-beta fit (all_reduce)")


def timeline(spans: Iterable[Any], *, title: str = "Per-rank timeline") -> plt.Figure:
    """Gantt chart: one row per rank; compute spans above the line, comm below it.

    `spans`: Span objects or dicts with rank, name, kind, start, end (seconds,
    one shared clock). Overlap shows as a comm bar under a compute bar.
    """
    rows = [s if isinstance(s, Mapping) else s.__dict__ for s in spans]
    if not rows:
        raise ValueError("no spans to plot")
    t0 = min(r["start"] for r in rows)
    ranks = sorted({r["rank"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 0.9 * len(ranks) + 1.2))
    for r in rows:
        # The y axis is inverted below (rank 0 on top): compute takes the upper half of a row.
        y = ranks.index(r["rank"]) + (-0.18 if r["kind"] == "compute" else 0.18)
        ax.barh(y, (r["end"] - r["start"]) * 1e3, left=(r["start"] - t0) * 1e3, height=0.34,
                color=KIND_COLORS[r["kind"]], edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(ranks)), [f"rank {k}" for k in ranks])
    ax.set_xlabel("time (ms)")
    ax.set_title(title + "  (blue: compute, orange: communication)", fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


def measured_vs_theory(xs: Sequence[float], measured: Sequence[float], theory: Sequence[float], *,
                       xlabel: str, ylabel: str, title: str, unit: float = 1.0) -> plt.Figure:
    """Measured points and the closed form as a line, e.g. memory per rank vs N."""
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    ax.plot(xs, [t / unit for t in theory], "-", color="black", label="theory")
    ax.plot(xs, [m / unit for m in measured], "o", color="#DD8452", label="measured")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def paired_bars(labels: Sequence[str], measured: Sequence[float | None], theory: Sequence[float | None], *,
                xlabel: str, title: str, log: bool = False) -> plt.Figure:
    """Horizontal bars, one pair per label: measured (solid) beside theory (hatched); either is left out where
    None (a variant only theory describes). Horizontal, so that long labels stay readable at any count without
    widening the figure; `log` for values that span orders of magnitude."""
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(labels) + 1.3))
    ys = range(len(labels))
    ax.barh([y - 0.2 for y in ys], [m or 0 for m in measured], 0.38, color="#4C72B0", label="measured")
    ax.barh([y + 0.2 for y in ys], [t or 0 for t in theory], 0.38, color="white", edgecolor="black", hatch="//",
            label="theory")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def ratio_spread_bars(labels: Sequence[str], ratios: Sequence[float], spreads: Sequence[tuple[float, float]], *,
                      title: str, xlabel: str = "ratio (1 = as fast as the baseline)") -> plt.Figure:
    """One dot per race at its ratio, a bar across its spread (e.g. the middle half of the paired per-repeat
    ratios), a line at 1: which differences the run can tell from noise."""
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(labels) + 1.3))
    ys = list(range(len(labels)))
    lo = [r - s[0] for r, s in zip(ratios, spreads)]
    hi = [s[1] - r for r, s in zip(ratios, spreads)]
    ax.axvline(1, color="black", lw=0.8)
    ax.errorbar(ratios, ys, xerr=[lo, hi], fmt="o", color="#C44E52", ecolor="#C44E52", capsize=3)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig



def grouped_bars(groups: Mapping[str, Mapping[str, float]], *, ylabel: str, title: str, unit: float = 1.0,
                 colors: Sequence[str] = ("#c64", "#69b", "#ccc", "#4a7")) -> plt.Figure:
    """Vertical bars: one group per key of `groups` (e.g. N=2, N=4), one bar per series inside it (e.g. the
    step, the step under no_sync, a bare all-reduce); every group has the same series, in the same order."""
    names = list(groups)
    series = list(next(iter(groups.values()))) if groups else []
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(names) * max(len(series), 1) / 2 + 2), 3.2))
    for i, (key, color) in enumerate(zip(series, list(colors) * 4)):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [groups[g][key] / unit for g in names], width, label=key, color=color)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig




COLLECTIVE_COLORS = {"all_reduce": "#8ab", "reduce_scatter": "#2a7", "all_gather": "#6c9", "broadcast": "#c64"}


def traffic_bars(labels: Sequence[str], by_kind: Sequence[Mapping[str, float]], theory: Sequence[float], *,
                 title: str, theory_label: str = "theory", unit: float = MB) -> plt.Figure:
    """Horizontal bars, one per run, stacked by collective from the comm meter's bytes per kind
    (`CommStats.bytes`), with a dashed tick at each run's theory."""
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 1.2))
    kinds = [k for k in COLLECTIVE_COLORS if any(k in b for b in by_kind)]
    kinds += sorted({k for b in by_kind for k in b} - set(kinds))
    for i, bytes_ in enumerate(by_kind):
        left = 0.0
        for kind in kinds:
            v = bytes_.get(kind, 0) / unit
            ax.barh(i, v, left=left, color=COLLECTIVE_COLORS.get(kind, "#8C8C8C"), label=kind.replace("_", "-"))
            left += v
        ax.plot([theory[i] / unit] * 2, [i - 0.4, i + 0.4], "k--", label=theory_label)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))                       # one legend entry per kind, not per bar
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB sent per rank per step (rank 0)" if unit == MB else f"x{unit:g} bytes sent per rank per step")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def stage_panels(labels: Sequence[str], measured: Sequence[Mapping[str, float]],
                 predicted: Sequence[Mapping[str, float]], peaks: Sequence[float], throughput: Sequence[float], *,
                 title: str, throughput_title: str = "samples/s", unit: float = 1e6) -> plt.Figure:
    """Three panels, one bar (group) per strategy: model states by component, measured (solid) beside theory
    (hatched); the peak bytes during a step; throughput. `measured`/`predicted`: {params, grads,
    optimizer_state: bytes}; `peaks` in bytes; `throughput` in samples/s."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    x = range(len(labels))
    for j, (series, hatch) in enumerate(((measured, None), (predicted, "//"))):
        bottom = [0.0] * len(labels)
        for comp in ("params", "grads", "optimizer_state"):
            vals = [s[comp] / unit for s in series]
            axes[0].bar([i + (j - 0.5) * 0.38 for i in x], vals, 0.38, bottom=bottom, color=COMPONENT_COLORS[comp],
                        hatch=hatch, alpha=1 if j == 0 else 0.45, label=(comp.replace("_", " ") if j == 0 else None))
            bottom = [b + v for b, v in zip(bottom, vals)]
    ylabel = "MB" if unit == 1e6 else f"x{unit:g} bytes"
    axes[0].set(title="Model states per rank: measured (solid) vs theory (hatched)", ylabel=ylabel)
    axes[1].bar(x, [p / unit for p in peaks], color="#8172B2")
    axes[1].set(title="Peak bytes per rank during one step (measured)", ylabel=ylabel)
    axes[2].bar(x, list(throughput), color="#C44E52")
    axes[2].set(title=throughput_title, ylabel="samples/s")
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
