"""How long grading takes: seconds per submission for each lab, with --jobs 1 and --jobs 2.

    .venv/bin/python tools/grading_bench.py                      # every lab with a check module, 4 submissions each
    .venv/bin/python tools/grading_bench.py --labs 01_collectives --count 6

(A benchmark, not the grader: it lived in distlab/grading/ until issue 38; tools/class_run_bench.py times a class.)

Each submission is the lab's solution with a different comment in one answer
cell (so none is graded as a copy of another): every case of every task
runs, the most work a submission can cost. References are computed once
before the clock starts, as in a class run. Besides wall seconds it reports
the CPU seconds a submission's sandbox used (runner, fork server, ranks):
that figure barely depends on the load, so on an idle machine with C cores
a class takes at least CPU s x submissions / C. The load average is printed
with the figures: on a busy machine the wall seconds mean little.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from distlab.checks.labs import BEGIN, END

ROOT = Path(__file__).resolve().parents[1]


def labs_with_modules() -> list[str]:
    from distlab.checks import LABS
    out = []
    for lab, module in LABS.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        if (ROOT / "labs" / f"{lab}.ipynb").exists() and (ROOT / "solutions" / f"{lab}.ipynb").exists():
            out.append(lab)
    return out


def submissions(lab: str, count: int, folder: Path) -> Path:
    """`count` copies of the lab filled with the solution's answers, each with its own comment."""
    shipped = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    solution = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    answers = {c.id: "\n".join(line for line in c.source.splitlines() if line.strip() not in (BEGIN, END))
               for c in solution.cells if c.cell_type == "code" and BEGIN in c.source}
    target = folder / lab
    target.mkdir(parents=True)
    for k in range(count):
        nb = nbformat.from_dict(shipped)
        for cell in nb.cells:
            if cell.get("id") in answers:
                cell.source = answers[cell.id] + f"\n# learner {k}\n"
        nbformat.write(nb, target / f"learner{k}.ipynb")
    return target


def measure(lab: str, count: int, jobs: int, sandbox: list[str] | None) -> tuple[float, float, float]:
    """(wall seconds per submission, CPU seconds per submission, the first one's fraction of full marks)."""
    from distlab.grading.classrun import grade
    from distlab.grading.grade import Options, prepare
    the_lab = prepare(lab)
    with tempfile.TemporaryDirectory(prefix="distlab-bench-") as tmp:
        folder = submissions(lab, count, Path(tmp))
        start = time.monotonic()
        results = grade(the_lab, [folder], jobs=jobs, opts=Options(sandbox=sandbox))
        took = time.monotonic() - start
    cpu = sum(r.cpu_s for r in results) / count
    return took / count, cpu, results[0].score / max(results[0].max_score, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/grading_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--labs", nargs="*", default=None, help="labs to time (default: every lab with checks)")
    ap.add_argument("--count", type=int, default=4, help="submissions per lab and jobs setting (default 4)")
    ap.add_argument("--jobs", type=int, nargs="*", default=[1, 2], help="--jobs settings to time (default 1 2)")
    ap.add_argument("--no-sandbox", action="store_true", help="time without bubblewrap")
    args = ap.parse_args(argv)
    from distlab.grading.cli import sandbox_for
    box = sandbox_for(args.no_sandbox, lambda text: print(text, file=sys.stderr))
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; "
          f"{args.count} submissions per row, {'in bubblewrap' if box else 'without a sandbox'}", flush=True)
    print("| lab | " + " | ".join(f"--jobs {j}: s per submission" for j in args.jobs)
          + " | CPU s per submission | solution's score |")
    print("|---|" + "---|" * (len(args.jobs) + 2), flush=True)
    for lab in args.labs or labs_with_modules():
        cells, cpus, score = [], [], 0.0
        for jobs in args.jobs:
            per, cpu, score = measure(lab, args.count, jobs, box)
            cells.append(f"{per:.1f}")
            cpus.append(cpu)
        print(f"| {lab} | " + " | ".join(cells) + f" | {min(cpus):.1f} | {score:.0%} |", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
