"""The `distlab grade` subcommand."""
from __future__ import annotations

from pathlib import Path


def add_parser(sub):
    g = sub.add_parser("grade", help="(instructors) grade learners' lab notebooks against the shipped checks")
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
                   help="keep each graded notebook in DIR/NAME-HASH/")
    g.add_argument("--self", action="store_true",
                   help="a learner checking their own labs/LAB.ipynb (or the given notebook) before handing it in")
    return g


def run(args) -> int:
    from distlab.grading.grade import main
    return main(args)
