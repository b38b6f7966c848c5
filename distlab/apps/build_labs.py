"""`distlab build-labs`: regenerate labs/ from solutions/ (a maintainer's command; see `distlab.checks.labs`)."""
from __future__ import annotations

from pathlib import Path

from distlab.checks.labs import build_labs


def add_parser(sub):
    b = sub.add_parser("build-labs", help="(maintainers) regenerate labs/ from solutions/, answers removed")
    b.add_argument("--check", action="store_true", help="exit 1 if labs/ is out of date; write nothing")
    b.add_argument("--force", action="store_true", help="overwrite labs edited since they were generated")
    b.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: here)")
    return b


def run(args) -> int:
    changed, refused = build_labs(args.root, check=args.check, force=args.force)
    for p in changed:
        print(("stale: " if args.check else "wrote: ") + str(p))
    for p in refused:
        print(f"kept: {p} was edited since it was generated (someone's work); --force overwrites it")
    if not changed and not refused:
        print("labs/ is up to date")
    return 1 if (args.check and changed) or refused else 0
