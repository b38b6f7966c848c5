"""Issue 38's class run: 30 hand-ins of lab 01 graded by `distlab grade --jobs 2`, timed (a benchmark, not a test).

    .venv/bin/python tools/class_run_bench.py [--count 30] [--jobs 2] [--keep DIR]

The hand-ins are generated from the shipped lab and its solution (tests/fixtures/grading/make_class.py): a
class of the chapter-1 kinds in turn (correct, wrong, partial, crashing, hanging, not started), each made
distinct by a comment naming its student, so that none is graded once for another (identical answer cells
are). Every task and every case of the lab is graded, sandboxed when bubblewrap works, as an instructor runs
it. Prints the wall time, the CPU time of the sandboxes, the slowest hand-ins, whether every report was
written, and the scores by kind; exits 1 when a report is missing or a hand-in was not graded.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("correct", "wrong", "partial", "crashing", "hanging", "not_started")
REPORTS = ("grades.html", "grades.csv", "grades.md", "lines.csv", "junit.xml")


def _make_class() -> object:
    spec = importlib.util.spec_from_file_location("make_class", ROOT / "tests/fixtures/grading/make_class.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    return mk


def hand_ins(count: int, folder: Path) -> dict[str, str]:
    """Write `count` distinct hand-ins to `folder`; student name -> its kind."""
    import nbformat
    mk = _make_class()
    cls = mk.ch1_class()
    answer_ids = {c.id for c in mk._answer_cells(mk.shipped("01_collectives"))}
    kinds = {}
    for k in range(count):
        kind = KINDS[k % len(KINDS)]
        nb = nbformat.reads(nbformat.writes(cls[kind]), as_version=4)
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.get("id") in answer_ids)
        cell.source = f"# student {k:02d}\n" + cell.source
        name = f"student{k:02d}_{kind}"
        (folder / f"{name}.ipynb").write_text(nbformat.writes(nb))
        kinds[name] = kind
    return kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--keep", type=Path, default=None, help="keep the hand-ins, reports and runner logs here")
    args = ap.parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distlab-class-bench-"))
    subs, out = base / "handins", base / "grades"
    subs.mkdir(parents=True, exist_ok=True)
    kinds = hand_ins(args.count, subs)
    cmd = [sys.executable, "-m", "distlab.apps.cli", "grade", "01_collectives", str(subs), "--jobs", str(args.jobs),
           "--out", str(out)] + (["--keep", str(base / "logs")] if args.keep else [])
    print(f"{len(kinds)} hand-ins in {subs}\n$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, DISTLAB_DEVICE_AUDIT=os.environ.get("DISTLAB_DEVICE_AUDIT", "0"))
    start = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=base)
    wall = time.monotonic() - start
    import csv
    written = {name: (out / name).exists() and (out / name).stat().st_size > 0 for name in REPORTS}
    rows = list(csv.DictReader(open(out / "lines.csv"))) if written["lines.csv"] else []
    totals = {Path(r["submission"]).stem: r for r in rows if r["check"] == "TOTAL"}
    by_kind = Counter()
    for name, kind in kinds.items():
        row = totals.get(name)
        by_kind[(kind, row["points"] if row else "missing")] += 1
    print(run.stdout[-3000:], run.stderr[-2000:], sep="\n")
    print(f"exit status {run.returncode}; wall {wall:.0f} s for {len(kinds)} hand-ins with --jobs {args.jobs}")
    print("reports:", ", ".join(f"{n} {'written' if ok else 'MISSING'}" for n, ok in written.items()))
    print("scores by kind:", ", ".join(f"{k}: {p} x{c}" for (k, p), c in sorted(by_kind.items())))
    ok = all(written.values()) and len(totals) == len(kinds) and run.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
