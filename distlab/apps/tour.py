"""`distlab tour`: every chapter's measurements on this machine, in one report.

Steps, each behind one progress bar:
1. the machine record (backend, devices, versions);
2. launcher timings, each world size in a fresh process (a first launch must be first);
3. the library busbw sweep (`distlab.bench.collectives`);
4. scale, simulated: the ZeRO table at 7.5B parameters on 64 ranks, measured from the shipped
   solutions' classes and PyTorch's DDP as rank 0 of 64 on fake tensors (`distlab.course.sim`; seconds);
5. the chapters' lecture and solution notebooks, executed headlessly with
   nbclient (as nbval does); each writes its own records with
   `distlab.record` into the output folder, so what a learner sees and what
   the tour reports come from one code path.
Then `summary.json`, PNG figures and `report.md` are written to `--out`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# Notebooks that record measurements, in curriculum order. Missing ones are skipped.
TOUR_NOTEBOOKS = (
    "solutions/01_collectives.ipynb",
    "notebooks/02_ddp_lecture.ipynb",
    "solutions/02_ddp.ipynb",
    "solutions/03_zero1.ipynb",
    "notebooks/04_zero2_lecture.ipynb",
    "solutions/04_zero2.ipynb",
    "solutions/05_zero3.ipynb",
    "notebooks/06_fsdp_lecture.ipynb",
    "solutions/06_fsdp.ipynb",
    "notebooks/07_tensor_parallel_lecture.ipynb",
    "solutions/07_tensor_parallel.ipynb",
    "notebooks/08_pipeline_3d_lecture.ipynb",
    "solutions/08_pipeline.ipynb",
    "notebooks/09_training_lecture.ipynb",
    "solutions/09_training.ipynb",
    "notebooks/10_moe_lecture.ipynb",
    "solutions/10_moe.ipynb",
)


def repo_root() -> Path | None:
    """The checkout holding notebooks/ (an editable install), or None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "notebooks").is_dir() else None


def sweep_sizes(quick: bool, on_gpu: bool) -> list[int]:
    """1 KiB up to 4 MiB (quick), 64 MiB (CPU) or 1 GiB (GPU), by factors of 4."""
    top = 22 if quick else (30 if on_gpu else 26)
    return [2 ** k for k in range(10, top + 1, 2)]


def _launcher_record(world_size: int, repeats: int) -> dict[str, Any]:
    """First launch and relaunch, measured in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-m", "distlab.bench.launcher", "--world-sizes", str(world_size),
                          "--repeats", str(repeats)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"launcher benchmark failed:\n{out.stderr[-2000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])[0]
    return {k: rec[k] for k in ("world_size", "first_launch_s", "relaunch_s")}


def _code_cells(path: Path) -> int:
    import nbformat

    from distlab.checks.labs import is_check_cell
    nb = nbformat.read(path, as_version=4)
    return sum(1 for c in nb.cells if c.cell_type == "code" and not is_check_cell(c))


def _execute_notebook(path: Path, out: Path, quick: bool, world_size: int, on_cell: Any = None) -> float:
    """Run one notebook headlessly in its own folder; it records into `out`. Raises on a failing cell."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    from distlab.checks.labs import is_check_cell
    env = {"DISTLAB_RESULTS": str(out.resolve()), "DISTLAB_QUICK": "1" if quick else "0",
           "DISTLAB_WORLD_SIZE": str(world_size), "MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    start = time.perf_counter()
    try:
        nb = nbformat.read(path, as_version=4)
        # Graded checks verify answers (tests and grading do that); they measure nothing.
        nb.cells = [c for c in nb.cells if not is_check_cell(c)]
        km = KernelManager(kernel_name="python3")
        # The kernel runs over loopback TCP; its warning about unencrypted TCP is noise here.
        NotebookClient(nb, km=km, timeout=None, resources={"metadata": {"path": str(path.parent)}},
                       extra_arguments=["--IPKernelApp.log_level=ERROR"],
                       on_cell_executed=(lambda **_: on_cell()) if on_cell else None).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return time.perf_counter() - start


def _figures(summary: dict[str, Any], out: Path) -> list[str]:
    from distlab.viz import plots
    made = []
    if summary.get("collectives"):
        fig = plots.busbw_sweep(summary["collectives"], title=f"busbw vs size ({summary['machine']['backend']}, "
                                f"{summary['collectives'][0]['world_size']} ranks)")
        fig.savefig(out / "collectives_busbw.png", dpi=110)
        made.append("collectives_busbw.png")
    strategies = [dict(s, predicted_model_state_bytes=_components(s.get("predicted_model_state_bytes")),
                       model_state_bytes=_components(s["model_state_bytes"]))
                  for s in summary.get("strategies") or []]
    if strategies:
        by_name = {_label(s): s for s in strategies}
        fig = plots.memory_bars([s["model_state_bytes"] for s in by_name.values()], list(by_name),
                                [s.get("predicted_model_state_bytes", {}) for s in by_name.values()])
        fig.savefig(out / "strategies_memory.png", dpi=110)
        fig = plots.value_bars({k: s["samples_per_s"] for k, s in by_name.items() if s.get("samples_per_s")},
                               ylabel="samples/s", title="Throughput by strategy, each timed alone (measured)")
        fig.savefig(out / "strategies_throughput.png", dpi=110)
        made += ["strategies_memory.png", "strategies_throughput.png"]
        scaling = _memory_vs_n(strategies)
        if scaling is not None:
            scaling.savefig(out / "strategies_memory_vs_n.png", dpi=110)
            made.append("strategies_memory_vs_n.png")
    curves = [r for r in summary.get("training") or [] if r.get("name") == "curves"]
    if curves:
        made.append(_training_curves(curves[-1], out))
    return made


def _training_curves(rec: dict[str, Any], out: Path) -> str:
    """Chapter 9: every strategy's loss over the one-process curve (lecture 9's record)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    one = rec["single"]
    ax.plot(one["steps"], one["loss"], color="black", lw=3, alpha=0.35, label="one process")
    for name, s in rec["strategies"].items():
        ax.plot(one["steps"][:len(s["loss"])], s["loss"], lw=1,
                label=f"{name} (max |Δloss| {s['max_abs_dloss']:.0e})")
    ax.set_xlabel("step"); ax.set_ylabel("loss")
    ax.set_title(f"Training on the stdlib's source, {rec['world_size']} ranks (measured)", fontsize=9)
    ax.legend(fontsize=7); fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=110)
    plt.close(fig)
    return "training_curves.png"


def _label(s: dict[str, Any]) -> str:
    """'zero1\nN=2, bf16+fp32 Adam' for a strategy record (name, N and recipe on the bar)."""
    recipe = f", {s['recipe']}" if s.get("recipe") else ""
    backend = f", {s['backend']}" if s.get("backend") and s.get("backend") != "gloo" else ""
    return f"{s['name']}\nN={s['world_size']}{recipe}{backend}"


def _components(value: Any) -> dict[str, float]:
    """Bytes by component; a bare number (a total without a split) becomes {"total": n}."""
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else {"total": value}


def _memory_vs_n(strategies: list[dict[str, Any]]) -> Any:
    """Model-state bytes per rank vs N, measured (points) and predicted (lines), per strategy."""
    import matplotlib.pyplot as plt
    series: dict[str, list[tuple[int, float, float]]] = {}
    for s in strategies:
        predicted = sum(_components(s.get("predicted_model_state_bytes")).values())
        measured = sum(_components(s["model_state_bytes"]).values())
        series.setdefault(s["name"], []).append((s["world_size"], measured, predicted))
    series = {k: sorted(v) for k, v in series.items() if len({n for n, _, _ in v}) > 1}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, pts) in enumerate(sorted(series.items())):
        color = f"C{i}"
        ns = [p[0] for p in pts]
        # Each strategy against its own theory line (fully_shard without resharding: 16Ψ/N at rest).
        ax.plot(ns, [p[2] / 2**20 for p in pts], "-", color=color, alpha=0.6, label=f"{name}: theory")
        ax.plot(ns, [p[1] / 2**20 for p in pts], "o", color=color, label=f"{name}: measured")
    ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("N (ranks)")
    ax.set_ylabel("model-state MiB per rank")
    ax.set_title("Model-state memory per rank vs N (points: measured, lines: theory)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


SCALE_PARAMS, SCALE_WORLD_SIZE = 7.5e9, 64


def scale_records(quick: bool) -> list[dict[str, Any]]:
    """The `scale` section: each ZeRO stage at 7.5B on 64 ranks, simulated (`distlab simulate`), one record
    per strategy with its closed forms beside it. Quick mode: the same Ψ in 2 layers of h = 8192 and a
    vocabulary that makes up the rest (ZeRO-3 still has 4 units; the bytes are the same closed forms, for
    about 60 % of the 8-layer version's CPU time); full mode: the calculator's 36 layers of 4096."""
    from distlab.apps.simulate import lab_class
    from distlab.course import sim
    from distlab.meters.records import record
    config = (sim.scale_config(SCALE_PARAMS, d_model=8192, n_layers=2, n_heads=64) if quick
              else sim.scale_config(SCALE_PARAMS))
    rows = []
    for name in ("ddp", "zero1", "zero2", "zero3"):
        try:
            classes = lab_class(name)
        except (FileNotFoundError, ValueError):
            continue   # not a checkout with solutions/: the stages that need a lab class are left out
        r = sim.simulate(name, config=config, world_size=SCALE_WORLD_SIZE, classes=classes, steps=1)
        state = r.model_state
        rows.append(record("scale", name=name, world_size=r.world_size, num_params=r.num_params,
                           backend="fake", layers=config.n_layers, d_model=config.d_model, simulated=True,
                           model_state_bytes={"params": state.params, "grads": state.grads,
                                              "optimizer_state": state.optimizer_state},
                           predicted_model_state_bytes=r.predicted_model_state_bytes,
                           comm_bytes_per_step=r.comm_bytes_per_step,
                           predicted_comm_bytes_per_step=r.predicted_comm_bytes_per_step,
                           collective_calls=dict(r.comm.calls),
                           peak_bytes=r.peak_bytes, simulation_s=round(r.seconds, 2)))
    return rows


def run_tour(out: Path, quick: bool = False, world_size: int | None = None, notebooks: bool = True) -> int:
    """Run the tour; return an exit status (1 if a notebook failed: the others still run)."""
    from distlab.bench.collectives import sweep
    from distlab.engine.machine import machine
    from distlab.engine.precision import bf16_speed_ratio
    from distlab.meters.records import load_records, yours_dir

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.jsonl"):
        stale.unlink()  # a tour's summary holds this run's measurements only
    info = machine()
    info["bf16_over_fp32"] = bf16_speed_ratio()
    on_gpu = info["backend"] == "nccl"
    n = world_size or (info["gpu_count"] if on_gpu else 4)
    root = repo_root()
    nb_paths = [root / p for p in TOUR_NOTEBOOKS if root and (root / p).exists()] if notebooks else []
    launcher_sizes = sorted({2, n}) if n > 1 else [1]
    cells = {p: _code_cells(p) for p in nb_paths}
    total = len(launcher_sizes) + 2 + sum(cells.values())
    summary: dict[str, Any] = {"machine": info, "mode": "quick" if quick else "full", "launcher": []}
    timings: dict[str, float] = {}
    failures: list[str] = []
    with tqdm(total=total, desc="distlab tour", unit="cell", dynamic_ncols=True) as bar:
        for k in launcher_sizes:
            bar.set_postfix_str(f"launcher x{k}")
            summary["launcher"].append(_launcher_record(k, repeats=3 if quick else 10))
            bar.update()
        bar.set_postfix_str(f"collectives sweep x{n}")
        summary["collectives"] = sweep(n, sweep_sizes(quick, on_gpu), repeats=3 if quick else 5)
        bar.update()
        bar.set_postfix_str(f"scale: {SCALE_PARAMS / 1e9:g}B on {SCALE_WORLD_SIZE} ranks, simulated")
        saved = os.environ.get("DISTLAB_RESULTS")
        os.environ["DISTLAB_RESULTS"] = str(out.resolve())   # recorded into `out`, as the notebooks' records
        try:
            scale_records(quick)
        finally:
            if saved is None:
                os.environ.pop("DISTLAB_RESULTS", None)
            else:
                os.environ["DISTLAB_RESULTS"] = saved
        bar.update()
        for path in nb_paths:
            rel = str(path.relative_to(root))
            bar.set_postfix_str(rel)
            done_before = bar.n
            try:
                timings[rel] = _execute_notebook(path, out, quick, n, on_cell=lambda: bar.update())
            except Exception as exc:  # noqa: BLE001 - one chapter failing must not hide the others
                reason = str(exc).strip().splitlines()
                failures.append(f"{rel}: {reason[-1] if reason else type(exc).__name__}")
                tqdm.write(f"distlab tour: {rel} failed: {reason[-1] if reason else exc}")
            bar.update(cells[path] - (bar.n - done_before))
    for section, rows in load_records(out).items():
        summary.setdefault(section, []).extend(rows)
    mine = yours_dir()
    if mine.is_dir() and mine.resolve() != out.resolve():
        summary["yours"] = load_records(mine)   # the learner's own notebook runs, shown beside the tour's
    summary["notebooks"] = timings
    summary["failures"] = failures
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    figures = _figures(summary, out)
    from distlab.viz.report import write
    md, page = write(summary, figures, out)
    print(f"wrote {out / 'summary.json'}, {md}, {page} and {len(figures)} figure(s)")
    for rec in summary["launcher"]:
        print(f"  launch x{rec['world_size']}: first {rec['first_launch_s']:.2f} s, relaunch {rec['relaunch_s']:.3f} s")
    big = [r for r in summary["collectives"] if r["op"] == "all_reduce" and r["impl"] == "library"][-1]
    print(f"  all-reduce busbw at {big['bytes'] / 2**20:.0f} MiB on {n} ranks: {big['busbw_GBps']:.2f} GB/s")
    scale = summary.get("scale") or []
    if scale:
        gb = " / ".join(f"{sum(r['model_state_bytes'].values()) / 1e9:.1f}" for r in scale)
        print(f"  simulated {SCALE_PARAMS / 1e9:g}B on {SCALE_WORLD_SIZE} ranks, model states per rank "
              f"({' / '.join(r['name'] for r in scale)}): {gb} GB")
    for f in failures:
        print(f"  FAILED {f}")
    return 1 if failures else 0


def add_parser(sub):
    from pathlib import Path as _Path
    t = sub.add_parser("tour", help="run every chapter's measurements; write results/summary.json, figures, report")
    t.add_argument("--quick", action="store_true", help="small sizes and few repeats (minutes on a laptop)")
    t.add_argument("--world-size", type=int, default=None, help="ranks for the measurements (default: 4, or #GPUs)")
    t.add_argument("--out", type=_Path, default=_Path("results"), help="output folder (default: results)")
    t.add_argument("--skip-notebooks", action="store_true", help="only the package's own benchmarks")
    return t


def run(args) -> int:
    return run_tour(out=args.out, quick=args.quick, world_size=args.world_size, notebooks=not args.skip_notebooks)
