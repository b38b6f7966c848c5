"""The `distlab` command: doctor, tour, labs (and grade, once labs are graded)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="distlab", description="A measured course in distributed training.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="what this machine can run (backend, GPUs, world sizes)")
    d.add_argument("--run", action="store_true", help="also launch a short job on every usable backend")

    t = sub.add_parser("tour", help="run every chapter's measurements; write results/summary.json, figures, report")
    t.add_argument("--quick", action="store_true", help="small sizes and few repeats (minutes on a laptop)")
    t.add_argument("--world-size", type=int, default=None, help="ranks for the measurements (default: 4, or #GPUs)")
    t.add_argument("--out", type=Path, default=Path("results"), help="output folder (default: results)")
    t.add_argument("--skip-notebooks", action="store_true", help="only the package's own benchmarks")

    lb = sub.add_parser("labs", help="regenerate labs/ from solutions/ (answers removed)")
    lb.add_argument("--check", action="store_true", help="exit 1 if labs/ is out of date")
    lb.add_argument("--root", type=Path, default=Path("."))

    g = sub.add_parser("grade", help="grade learners' lab notebooks against the shipped checks (see README)")
    g.add_argument("lab", help="a lab name (01_collectives) or the path of the shipped lab notebook")
    g.add_argument("submissions", nargs="*", type=Path, help="learners' notebooks, or folders of them")
    g.add_argument("--out", type=Path, default=None, help="write grades.csv, grades.md, junit.xml here")
    g.add_argument("--timeout", type=float, default=300, help="seconds per notebook cell (default 300)")
    g.add_argument("--rank-timeout", type=float, default=60,
                   help="cap on every launch of ranks inside a check, in seconds (default 60)")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    g.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="grade only the verdict lines containing TEXT (repeatable)")
    g.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep each graded notebook in DIR/NAME-HASH/ (graded.ipynb also runs under pytest --nbval-lax)")
    g.add_argument("--self", action="store_true",
                   help="a learner checking their own labs/LAB.ipynb (or the given notebook) before handing it in")

    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        from distlab.doctor import doctor
        return doctor(run=args.run)
    if args.cmd == "tour":
        from distlab.tour import run_tour
        return run_tour(out=args.out, quick=args.quick, world_size=args.world_size,
                        notebooks=not args.skip_notebooks)
    if args.cmd == "labs":
        from distlab.labs import sync_labs
        changed = sync_labs(args.root, check=args.check)
        for p in changed:
            print(("stale: " if args.check else "wrote: ") + str(p))
        return 1 if (args.check and changed) else 0
    if args.cmd == "grade":
        from distlab.grading import main as grade_main
        return grade_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
