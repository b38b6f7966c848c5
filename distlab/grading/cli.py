"""The `distlab grade` subcommand: `add_parser(subparsers)` and `run(args)`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

NO_BWRAP = ("distlab grade: bubblewrap (bwrap) is not installed, so submissions run WITHOUT a sandbox: "
            "their code can read every file this account can (solutions/, other submissions), see and signal "
            "your processes and use the network. Verdicts are still computed here and tampering is still "
            "recorded. Install it (Debian/Ubuntu: apt-get install bubblewrap) to grade a class.")
NO_SANDBOX = ("distlab grade: --no-sandbox: submissions run as you, with your files, processes and network "
              "in reach. Use it only for your own notebooks.")
BROKEN_BWRAP = ("distlab grade: bwrap is installed but cannot start a sandbox here (user namespaces may be "
                "disabled: sysctl kernel.unprivileged_userns_clone=1). Fix that, or pass --no-sandbox "
                "knowing what it means.")


def add_parser(sub: Any) -> Any:
    g = sub.add_parser("grade", help="(instructors) grade learners' lab notebooks, sandboxed; "
                                     "--self: check your own lab")
    g.add_argument("lab", help="a lab name (01_collectives) or the path of the shipped lab notebook")
    g.add_argument("submissions", nargs="*", type=Path, help="learners' notebooks, or folders of them")
    g.add_argument("--out", type=Path, default=None,
                   help="write grades.csv, grades.md, junit.xml here (default: ./grades, except with --self)")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    g.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="grade only the tasks (or verdict lines) containing TEXT (repeatable)")
    g.add_argument("--no-sandbox", action="store_true",
                   help="run submissions without bubblewrap (they can then read your files: own notebooks only)")
    g.add_argument("--backend", choices=("gloo", "auto", "nccl"), default="gloo",
                   help="backend of the graded ranks (default gloo: CPU, what every check is validated on)")
    g.add_argument("--stall", type=float, default=None, metavar="S",
                   help="seconds a case's ranks may all wait without work before it counts as hung (default 5)")
    g.add_argument("--case-cap", type=float, default=180, metavar="S",
                   help="last-resort limit on one case whose ranks keep working, in seconds (default 180)")
    g.add_argument("--cap", type=float, default=1800, metavar="S",
                   help="last-resort limit on one submission, in seconds (default 1800)")
    g.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep each runner's log in DIR")
    g.add_argument("--self", action="store_true",
                   help="a learner checking their own labs/LAB.ipynb (or the given notebook) before handing it in")
    return g


def sandbox_for(no_sandbox: bool, say: Any = print) -> list[str] | None:
    """The bwrap argv to grade in, or None (after saying what running without one means)."""
    from distlab.grading import sandbox
    if no_sandbox:
        say(NO_SANDBOX)
        return None
    if sandbox.bwrap_path() is None:
        say(NO_BWRAP)
        return None
    for user_ns in (True, False):
        if sandbox.works(user_ns):
            return sandbox.argv(user_ns)
    raise RuntimeError(BROKEN_BWRAP)


def run(args: Any) -> int:
    from distlab.checks.task import CHECK_STALL_S
    from distlab.grading.classrun import grade
    from distlab.grading.grade import Options, prepare
    from distlab.grading.lab import resolve_lab
    from distlab.grading.report import markdown
    err = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    subs = list(args.submissions)
    if args.self and not subs:
        try:
            shipped = resolve_lab(args.lab)
        except FileNotFoundError as exc:
            err(f"distlab grade: {exc}")
            return 2
        local = Path("labs") / shipped.name
        subs = [local if local.exists() else shipped]
    elif not subs:
        err("distlab grade: give at least one submission (a notebook or a folder), or --self")
        return 2
    out = args.out if args.out is not None or args.self else Path("grades")
    try:
        box = sandbox_for(args.no_sandbox, err)
        if args.self:
            print(f"checking {', '.join(map(str, subs))} against {args.lab}: computing the expected results...",
                  flush=True)
        lab = prepare(args.lab, args.only)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        err(f"distlab grade: {exc}")
        return 2
    opts = Options(sandbox=box, stall_s=args.stall or CHECK_STALL_S, submission_cap_s=args.cap,
                   case_cap_s=args.case_cap,
                   backend=args.backend, keep=args.keep,
                   progress=(lambda line: print("  " + line, flush=True)) if args.self else None)
    results = grade(lab, subs, out=out, jobs=args.jobs, opts=opts,
                    echo=None if args.self else (lambda line: print(line, flush=True)))
    print(markdown(results, detail=args.self))
    if out is not None:
        print(f"wrote {out}/grades.csv, grades.md, junit.xml")
    if args.self:
        for r in results:
            failed = [v.check for v in r.verdicts if v.reason]
            print(f"{r.submission}: {r.score:g}/{r.max_score:g} points, {len(r.verdicts) - len(failed)}/"
                  f"{len(r.verdicts)} checks passed in {r.seconds:.0f} s"
                  + (f"; first to fix: {failed[0]}" if failed else "; ready to hand in")
                  + (f"; audit: {r.flags[0]}" if r.flags else ""))
        return 0 if all(r.score == r.max_score for r in results) else 1
    return 0
