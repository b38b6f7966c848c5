"""The tour's report: the page a learner reads after `distlab tour` (Markdown and HTML).

Per chapter: the headline measured figures against theory and against
PyTorch's own implementation, each ratio with its noise, one sentence of
reading, and the figures. Built as a list of blocks rendered twice, so
`report.md` and `report.html` always say the same thing.

Conventions of the records (see `distlab.meters.records.record`): a measured `X`
sits beside its theory `predicted_X`; races are `races` records with a ratio
and the middle half of its paired per-repeat ratios.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MiB = 2 ** 20


@dataclass
class Report:
    """Blocks of a report: ('h1'|'h2'|'h3'|'p'|'table'|'img'|'chart'|'list', payload). A chart is a matplotlib
    figure drawn into the page itself (a PNG data URI in HTML; Markdown points at report.html)."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append((f"h{level}", text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def items(self, lines: list[str]) -> None:
        if lines:
            self.blocks.append(("list", lines))

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        if rows:
            self.blocks.append(("table", (headers, [[_fmt(v) for v in r] for r in rows])))

    def img(self, path: str, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def chart(self, fig: Any, alt: str) -> None:
        """Keep `fig` (a matplotlib Figure) as a PNG in the page; the figure is closed."""
        import matplotlib.pyplot as plt
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        self.blocks.append(("chart", (base64.b64encode(buf.getvalue()).decode(), alt)))

    def markdown(self) -> str:
        out = []
        for kind, x in self.blocks:
            if kind.startswith("h"):
                out.append("#" * int(kind[1]) + " " + x)
            elif kind == "p":
                out.append(x)
            elif kind == "list":
                out.append("\n".join(f"- {line}" for line in x))
            elif kind == "table":
                headers, rows = x
                esc = [[c.replace("|", "\\|") for c in r] for r in [headers, *rows]]
                out.append("\n".join(["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(headers)]
                                     + ["| " + " | ".join(r) + " |" for r in esc[1:]]))
            elif kind == "img":
                out.append(f"![{x[1]}]({x[0]})")
            elif kind == "chart":
                out.append(f"*Chart: {x[1]} (in report.html).*")
        return "\n\n".join(out) + "\n"

    def html(self, title: str = "distlab tour report") -> str:
        body = []
        for kind, x in self.blocks:
            if kind.startswith("h"):
                body.append(f"<{kind}>{html.escape(x)}</{kind}>")
            elif kind == "p":
                body.append(f"<p>{html.escape(x)}</p>")
            elif kind == "list":
                body.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in x) + "</ul>")
            elif kind == "table":
                headers, rows = x
                head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
                cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
            elif kind == "img":
                body.append(f'<figure><img src="{html.escape(x[0])}" alt="{html.escape(x[1])}">'
                            f"<figcaption>{html.escape(x[1])}</figcaption></figure>")
            elif kind == "chart":
                body.append(f'<figure class="chart"><img src="data:image/png;base64,{x[0]}" alt="{html.escape(x[1])}">'
                            f"<figcaption>{html.escape(x[1])}</figcaption></figure>")
        # A dashboard without sideways scrolling: the page is at most the window's width, tables take the
        # column's width and wrap their cells (long numbers and names break), figures scale down.
        style = ("*{box-sizing:border-box}body{font-family:system-ui,sans-serif;max-width:62rem;margin:1.5rem auto;"
                 "padding:0 1rem;line-height:1.45;color:#222}table{border-collapse:collapse;margin:1rem 0;"
                 "font-size:.82rem;width:100%;table-layout:fixed}th,td{border:1px solid #ccc;padding:.2rem .35rem;"
                 "text-align:right;overflow-wrap:anywhere;word-break:break-word}th{background:#f3f3f3}"
                 "td:first-child,th:first-child{text-align:left}img{max-width:100%;height:auto}"
                 "figure{margin:1rem 0}figcaption{color:#666;font-size:.85rem}"
                 "h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}")
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _total(value: Any) -> float | None:
    """Bytes as a number: a dict of components sums up; None stays None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return float(sum(v for v in value.values() if isinstance(v, (int, float))))
    return float(value) if isinstance(value, (int, float)) else None


def _ratio(measured: Any, predicted: Any) -> str:
    m, p = _total(measured), _total(predicted)
    if m is None or p is None or p == 0:
        return ""
    return f"{m / p:.4f}x"


def measured_vs_predicted(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """A table of every `X` / `predicted_X` pair in `rows`, with the ratio, by name and world size."""
    pairs = sorted({k[len("predicted_"):] for r in rows for k in r if k.startswith("predicted_")
                    and k[len("predicted_"):] in r})
    headers = ["name", "N", "backend"]
    for p in pairs:
        headers += [p.replace("_", " ") + " (measured)", "theory", "ratio"]
    body = []
    for r in rows:
        line: list[Any] = [r.get("name", ""), r.get("world_size", ""), r.get("backend", "")]
        for p in pairs:
            m, t = _total(r.get(p)), _total(r.get(f"predicted_{p}"))
            scale = MiB if "bytes" in p else 1
            unit_m = "" if m is None else (m / scale if scale > 1 else m)
            unit_t = "" if t is None else (t / scale if scale > 1 else t)
            line += [unit_m, unit_t, _ratio(r.get(p), r.get(f"predicted_{p}"))]
        body.append(line)
    headers = [h.replace("bytes", "MiB") for h in headers]
    return headers, body


# ---- chapter sections ---------------------------------------------------------------------------

def _races(report: Report, races: list[dict[str, Any]]) -> None:
    from distlab.viz.plots import ratio_spread_bars
    labels = [f"{r['name']} vs {r['baseline']}" + (f", N={r['world_size']}" if "world_size" in r else "")
              for r in races]
    report.chart(ratio_spread_bars(labels, [r["ratio"] for r in races],
                                   [(r["spread_lo"], r["spread_hi"]) for r in races],
                                   title="Races: speed ratio, with the middle half of the paired per-repeat ratios"),
                 "Every race as one ratio with its spread: where the bar crosses 1, this run cannot tell the two "
                 "apart")
    lines = []
    for r in races:
        lines.append(f"{r['name']} ran at {r['ratio']:.2f}x {r['baseline']} (middle half of "
                     f"{r['repeats']} alternated repeats: {r['spread_lo']:.2f}–{r['spread_hi']:.2f}x"
                     + (", cut short by the time budget" if r.get("budget_hit") else "")
                     + (f"; N={r['world_size']}" if "world_size" in r else "") + ").")
    report.items(lines)


def _collectives(report: Report, s: dict[str, Any]) -> None:
    recs = [r for r in s.get("collectives", []) if r.get("impl") == "library"]
    if not recs:
        return
    n = recs[0]["world_size"]
    ops = sorted({r["op"] for r in recs})
    sizes = sorted({r["bytes"] for r in recs})
    rows = []
    for size in sizes:
        row: list[Any] = [f"{size / 1024:,.0f} KiB" if size < MiB else f"{size / MiB:,.0f} MiB"]
        for op in ops:
            hit = next((r for r in recs if r["op"] == op and r["bytes"] == size), None)
            row.append(hit["busbw_GBps"] if hit else "")
        rows.append(row)
    report.h(2, "Chapter 1 — Collectives")
    big = max(sizes)
    best = max((r for r in recs if r["bytes"] == big), key=lambda r: r["busbw_GBps"])
    report.p(f"Bus bandwidth (busbw, nccl-tests' definition: comparable across operations and N) of the "
             f"library's collectives on {n} ranks. Small messages are latency-bound and large ones "
             f"bandwidth-bound; at {big / MiB:.0f} MiB the fastest here was {best['op']} at "
             f"{best['busbw_GBps']:.2f} GB/s.")
    report.table(["message"] + [f"{op} busbw GB/s" for op in ops], rows)
    ring = s.get("ring_ratio", []) + (s.get("yours") or {}).get("ring_ratio", [])
    if ring:           # "your" only where the record says it came from the learner's lab notebook
        whose = lambda r: "Your" if r.get("source") in ("lab", "learner") else "The shipped solution's"  # noqa: E731
        report.items([f"{whose(r)} ring all-reduce at {r['bytes'] / MiB:.0f} MiB: {r['ratio']:.2f}x the library's "
                      f"busbw on {r['world_size']} ranks." for r in ring])


def _strategies(report: Report, s: dict[str, Any]) -> None:
    recs = s.get("strategies", [])
    if not recs:
        return
    report.h(2, "Chapters 2–6 — Data parallelism, ZeRO and FSDP")
    ok_state = [r for r in recs if r.get("predicted_model_state_bytes") is not None]
    worst = max((abs(_total(r["model_state_bytes"]) / _total(r["predicted_model_state_bytes"]) - 1)
                 for r in ok_state if _total(r.get("predicted_model_state_bytes"))), default=None)
    comm = [(r, r["comm_bytes_per_step"] / r["predicted_comm_bytes_per_step"]) for r in recs
            if r.get("predicted_comm_bytes_per_step")]
    close = [ratio for _, ratio in comm if abs(ratio - 1) <= 0.01]
    off = [f"{r['name']} (N={r['world_size']}) sent {ratio:.2f}x" for r, ratio in comm if abs(ratio - 1) > 0.01]
    sentence = f"{len(recs)} measurement{'s' if len(recs) != 1 else ''} of data-parallel strategies."
    if worst is not None:
        sentence += f" Model states per rank matched theory within {worst:.2%} in every one."
    if comm:
        sentence += (f" Algorithmic bytes sent per step matched 2Ψ(N-1)/N (DDP, ZeRO-1/2) or 3Ψ(N-1)/N (ZeRO-3) "
                     f"in {len(close)} of {len(comm)}")
        sentence += (f", within {max(abs(x - 1) for x in close):.2%}" if close else "")
        sentence += ("; " + ", ".join(off) + ": its chapter explains why" if off else "") + "."
    report.p(sentence)
    _strategy_charts(report, recs)
    headers, rows = measured_vs_predicted(recs)
    report.table(headers, rows)
    speed = [[r["name"], r["world_size"], r.get("recipe", ""), r.get("samples_per_s", ""),
              r.get("max_abs_param_diff_vs_single", "")] for r in recs]
    report.table(["name", "N", "recipe", "samples/s (alone)", "max abs Δ param vs one process"], speed)


def _strategy_charts(report: Report, recs: list[dict[str, Any]]) -> None:
    """Memory per rank and bytes per step of every strategy record, measured beside theory."""
    from distlab.viz.plots import paired_bars
    label = lambda r: f"{r.get('name', '?')}, N={r.get('world_size', '?')}" + (  # noqa: E731
        f", {r['recipe']}" if r.get("recipe") else "")
    mem = [r for r in recs if _total(r.get("model_state_bytes")) is not None]
    if mem:
        report.chart(paired_bars([label(r) for r in mem], [_total(r["model_state_bytes"]) / MiB for r in mem],
                                 [None if _total(r.get("predicted_model_state_bytes")) is None
                                  else _total(r["predicted_model_state_bytes"]) / MiB for r in mem],
                                 xlabel="MiB per rank", title="Model states per rank: measured and theory"),
                     "Memory per strategy, measured beside theory")
    comm = [r for r in recs if r.get("comm_bytes_per_step") is not None]
    if comm:
        report.chart(paired_bars([label(r) for r in comm], [r["comm_bytes_per_step"] / MiB for r in comm],
                                 [None if r.get("predicted_comm_bytes_per_step") is None
                                  else r["predicted_comm_bytes_per_step"] / MiB for r in comm],
                                 xlabel="MiB sent per rank per step (algorithmic bytes)",
                                 title="Traffic per step: measured and theory"),
                     "Traffic per strategy, measured beside theory")


# Chapter sections recorded by the notebooks: (chapter, heading, how to read the table).
TITLES: dict[str, tuple[int, str, str]] = {
    "zero_table": (6, "Chapter 6 — The ZeRO memory table, measured",
                   "Model states per rank for each ZeRO stage, against the paper's formulas."),
    "fsdp_meshes": (6, "Chapter 6 — FSDP2 on 1-D, HSDP and 2-D meshes",
                    "Traffic per step and model states per rank for each mesh layout, against theory."),
    "fsdp_hsdp": (6, "Chapter 6 — HSDP", "Model states per rank, sharded inside a group and replicated across."),
    "fsdp_activations": (6, "Chapter 6 — Activations under FSDP",
                         "Activation bytes held per row of the batch: what sharding the model states leaves."),
    "tp": (7, "Chapter 7 — Tensor parallelism (Megatron)",
           "Bytes per step and activation memory of the hand-written TP block, against theory."),
    "tp_torch": (7, "Chapter 7 — PyTorch's parallelize_module", "The same block through DTensor, against theory."),
    "sp": (7, "Chapter 7 — Sequence parallelism",
           "Reduce-scatter + all-gather at the all-reduce's bytes; norm and dropout activations cut by t."),
    "scale": (6, "Chapter 6 — The ZeRO table at 7.5B on 64 ranks, simulated",
              "Model states and bytes per step of each stage, from the shipped solutions' classes and DDP run as "
              "rank 0 of 64 on fake tensors, against the closed forms."),
    "cp_ring": (7, "Chapter 7 — Context parallelism: ring attention and Ulysses",
                "Bytes per step of the ring and of the all-to-all variant, peak memory, and the bytes kept for "
                "backward in training, against theory."),
    "cp_zigzag": (7, "Chapter 7 — Zig-zag ring attention (lab 7)",
                  "Attention FLOPs of the slowest rank, plain ring against zig-zag, against theory."),
    "zero3_vs_tp": (7, "Chapter 7 — ZeRO-3 against tensor parallelism",
                    "Bytes per step of each as tokens per step grow: weights against activations."),
    "tp_2d": (7, "Chapter 7 — 2-D: FSDP over data × TP over the model",
              "Traffic per group and memory per rank, against theory."),
    "pp_gpipe": (8, "Chapter 8 — Pipelines: GPipe",
                 "The bubble read off per-rank timelines against (p−1)/(m+p−1), and the activation peak in "
                 "micro-batches (CPU stages share cores: the bubble runs above theory under load)."),
    "pp_1f1b": (8, "Chapter 8 — Pipelines: 1F1B", "As GPipe, with at most p micro-batches in flight per stage."),
    "pp_torch": (8, "Chapter 8 — torch.distributed.pipelining", "PyTorch's schedules on the same stages."),
    "offload": (8, "Chapter 8 — ZeRO-Offload",
                "Bytes moved down and up per step against 2Ψ each way, and the device/host split of model states."),
    "mesh3d": (8, "Chapter 8 — 3-D (dp × tp × pp)",
               "Traffic per group and memory per rank on the 8-rank mesh, against theory."),
}


def _generic(report: Report, section: str, rows: list[dict[str, Any]]) -> None:
    _, title, reading = TITLES.get(section, (99, section.replace("_", " "), ""))
    report.h(2, title)
    if reading:
        report.p(reading)
    headers, body = measured_vs_predicted(rows)
    if len(headers) > 3:
        report.table(headers, body)
        return
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))][:8]
    report.table(keys, [[r.get(k, "") for k in keys] for r in rows])


SECTIONS: dict[str, Callable[[Report, dict[str, Any]], None]] = {
    "collectives": _collectives,
    "strategies": _strategies,
}
# Records that are not a chapter section of their own.
_HANDLED = {"machine", "mode", "launcher", "notebooks", "collectives", "ring_ratio", "strategies", "races",
            "choices", "failures", "yours"}


def _yours(report: Report, s: dict[str, Any]) -> None:
    """What the learner's own notebook runs recorded (results/yours/), a table per section."""
    yours = {k: v for k, v in (s.get("yours") or {}).items() if v}
    if not yours:
        return
    report.h(2, "Yours: the notebooks you ran by hand")
    report.p("Records your own runs of the labs and lectures wrote to results/yours/, oldest first. The tour "
             "never writes there; delete the folder to start afresh.")
    for section, rows in yours.items():
        report.h(3, f"{TITLES.get(section, (99, section.replace('_', ' '), ''))[1]} ({len(rows)} record"
                    f"{'s' if len(rows) != 1 else ''})")
        keys = [k for k in rows[-1] if not isinstance(rows[-1][k], (dict, list)) and k != "source"][:8]
        report.table(keys, [[r.get(k, "") for k in keys] for r in rows[-10:]])


def build(summary: dict[str, Any], figures: list[str]) -> Report:
    """The whole report from a tour summary and the figure files written beside it."""
    r = Report()
    m = summary["machine"]
    r.h(1, "distlab tour report")
    r.p(f"Measured on {m['device_count']} x {m['device_kind']} ({m['backend']}), torch {m['torch_version']}, "
        f"{m['cpu_count']} CPU cores, in {summary['mode']} mode. Every number here was measured in this run; "
        "theory appears only in the columns named so. CPU ranks talk over TCP loopback with gloo: the "
        "ratios carry over to GPUs, the seconds do not.")
    chosen = [f"CPU {m.get('cpu_capability', '?')}: "
              + ("native bf16" if m.get("cpu_native_bf16") else
                 f"no native bf16 (a bf16 matmul took {m.get('bf16_over_fp32', 0):.0f}x fp32), "
                 "so bf16-stored weights computed in fp32; stored and sent bytes stay bf16's")]
    chosen += [f"{n}: {t:.0f} s" for n, t in summary.get("notebooks", {}).items()]
    r.h(2, "What ran, and what was chosen")
    r.items(chosen)
    for fail in summary.get("failures", []):
        r.p(f"FAILED: {fail}")
    if summary.get("launcher"):
        r.h(2, "Chapter 0 — Launching ranks")
        lines = [f"{x['world_size']} ranks: first launch {x['first_launch_s']:.2f} s (starts the forkserver, "
                 f"which imports torch once), relaunch {x['relaunch_s']:.3f} s" for x in summary["launcher"]]
        r.items(lines)
    for section, render in SECTIONS.items():
        render(r, summary)
    if summary.get("races"):
        r.h(2, "Races: your implementations against PyTorch's, alternated in one run")
        _races(r, summary["races"])
    rest = [(section, rows) for section, rows in summary.items()
            if section not in _HANDLED and section not in SECTIONS and isinstance(rows, list) and rows
            and isinstance(rows[0], dict)]
    order = list(TITLES)
    for section, rows in sorted(rest, key=lambda kv: (order.index(kv[0]) if kv[0] in TITLES else len(order), kv[0])):
        _generic(r, section, rows)
    _yours(r, summary)
    if figures:
        r.h(2, "Figures")
        for f in figures:
            r.img(f, f.replace("_", " ").removesuffix(".png"))
    return r


def write(summary: dict[str, Any], figures: list[str], out: Path) -> tuple[Path, Path]:
    """report.md and report.html in `out`."""
    rep = build(summary, figures)
    (out / "report.md").write_text(rep.markdown())
    (out / "report.html").write_text(rep.html())
    return out / "report.md", out / "report.html"
