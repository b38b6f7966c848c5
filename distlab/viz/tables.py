"""Compact tables for the lectures, built from the meters' records: where a cell used to print a paragraph of
numbers, it displays one of these. Each returns an `IPython.display.Markdown` (display it, or read `.data`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from IPython.display import Markdown


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[bool] | None = None) -> Markdown:
    """A Markdown table; `right[i]`: right-align column i (numbers). Cells are written with str()."""
    right = list(right) if right is not None else [False] + [True] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


def size_label(n: float) -> str:
    """Bytes as a short binary size: 1 KiB, 64 KiB, 2 MiB, 1 GiB (3 significant digits when not a power of 2)."""
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n:.0f} B"


def _mbps(v: float) -> str:
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"          # 3 significant digits, never an exponent


def busbw_table(records: Iterable[Mapping[str, Any]], ops: Sequence[str], *, metric: str = "busbw_GBps") -> Markdown:
    """One row per message size, one column per collective in `ops`: the measured `metric` (GB/s in the records,
    shown in MB/s to 3 significant digits). `records`: as `distlab.bench.collectives.sweep` returns them;
    a size without a collective's record shows a dash."""
    by_size: dict[int, dict[str, float]] = {}
    for r in records:
        by_size.setdefault(int(r["bytes"]), {})[r["op"]] = r[metric]
    name = metric.split("_")[0]
    rows = [[size_label(s)] + [_mbps(by_size[s][op] * 1e3) if op in by_size[s] else "–" for op in ops]
            for s in sorted(by_size)]
    return markdown_table([f"S \\ {name}, MB/s", *ops], rows)


def stage_table(measured: Mapping[str, Mapping[str, Any]], predicted: Mapping[str, float], *,
                names: Sequence[str] | None = None) -> Markdown:
    """One row per strategy: model states measured at the step boundary against `predicted` (MB, and the
    surplus in bytes), the step's peak (MB), the bytes sent per step (MB) and the calls of each collective.
    `measured[name]`: {"state": a `ModelState`, "peak": bytes, "comm": `CommStats`} (one rank's)."""
    rows = []
    for name in names or list(predicted):
        m = measured[name]
        total = m["state"].total
        calls = ", ".join(f"{k} ×{v}" for k, v in m["comm"].calls.items()) or "none"
        rows.append([name, f"{total / 1e6:.3f}", f"{predicted[name] / 1e6:.3f}", f"{total - predicted[name]:+,.0f}",
                     f"{m['peak'] / 1e6:.2f}", f"{m['comm'].total_bytes / 1e6:.3f}", calls])
    return markdown_table(["strategy", "model states, MB", "theory, MB", "surplus, B", "peak, MB", "sent, MB/step",
                           "collectives per step"], rows, right=[False, True, True, True, True, True, False])


def _value(v: Any) -> str:
    if isinstance(v, Mapping):
        return " / ".join(_value(x) for x in v.values())
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def record_table(record: Mapping[str, Any], keys: Sequence[str]) -> Markdown:
    """A record (as `distlab.record` returns it) as one row per key: its value and, where the record has
    `predicted_<key>`, the prediction beside it; a dict value (bytes by role) shows its parts joined by ' / '."""
    rows = [[k.replace("_", " "), _value(record[k]), _value(record.get(f"predicted_{k}", "–"))] for k in keys]
    return markdown_table([f"record `{record.get('name', '')}`", "measured", "predicted"], rows)


def _per_step(values: Sequence[float]) -> str:
    """Each step's value to 2 decimals, or one value and the number of steps where they all agree."""
    shown = [f"{v:.2f}" for v in values]
    return f"{shown[0]} (all {len(shown)} steps)" if len(set(shown)) == 1 else " / ".join(shown)


def offload_table(result: Mapping[str, Any], theory: Any) -> Markdown:
    """ZeRO-Offload measured beside the plain optimizer and beside theory, one row each: the bytes per parameter
    each keeps on the device and on the host after a step, the bytes copied over the host link per step as a
    multiple of theory's (down in the backward, up after the step; every step's), and the peak of one step.
    `result`: `distlab.course.pipeline.offloaded.offload_demo`'s; `theory`: `distlab.theory.pipeline.offload(psi)`."""
    psi = result["psi"]
    down = _per_step([d / theory.down_bytes for d, _ in result["moved"]])
    up = _per_step([u / theory.up_bytes for _, u in result["moved"]])
    rows = [["offload (measured)", f"{result['offload']['device'] / psi:.2f}", f"{result['offload']['host'] / psi:.2f}",
             down, up, f"{result['peaks']['offload']:,}"],
            ["plain, on the device (measured)", f"{result['plain']['device'] / psi:.2f}",
             f"{result['plain']['host'] / psi:.2f}", "–", "–", f"{result['peaks']['plain']:,}"],
            ["ZeRO-Offload (theory)", f"{theory.device_bytes / psi:.0f}", f"{theory.host_bytes / psi:.0f}", "1", "1", "–"]]
    return markdown_table(["optimizer", "device, B/param", "host, B/param", "down per step / 2Ψ", "up per step / 2Ψ",
                           "peak of one step, B"], rows)
