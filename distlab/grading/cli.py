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


DESCRIPTION = """\
Grade learners' lab notebooks. Each submission's answer cells run on fresh ranks inside a bubblewrap
sandbox (own PID, IPC and network namespaces, loopback only; read-only Python environment and distlab
package; no solutions/, no other submission; a private /tmp), as an unprivileged uid, under limits on
processes, memory, CPU time and file size; once a rank's process group is up a seccomp filter refuses it
new sockets, processes and sessions. Verdicts are computed here, in this process, from the ranks' raw
outputs (tensors and JSON, never a pickle; bounds checked in a child process first) against references
computed without learner code; check cells in a submission are never run. Evidence of tampering (audit hooks installed before learner code) zeroes the
affected task and is listed in the Audit column. A broken, hanging or hostile submission gets a one-line
reason; the class run always finishes and always writes its reports."""

EPILOG = """\
examples:
  distlab grade 01_collectives submissions/ --jobs 2       a class: writes grades/grades.{html,csv,md}, ...
  distlab grade 02_ddp alice.ipynb bob.ipynb --out grades/02
  distlab grade 01_collectives submissions/ --only all_gather      one task (or the verdict lines matching)
  distlab grade --self 01_collectives                      a learner checks labs/01_collectives.ipynb

exit status: 0 when the run finished (whatever the grades; --self: 1 unless full marks), 2 when nothing was
graded (unknown lab, missing submission, sandbox unusable)."""


def add_parser(sub: Any) -> Any:
    import argparse
    g = sub.add_parser("grade", help="(instructors) grade learners' lab notebooks, sandboxed; "
                                     "--self: check your own lab", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("lab", help="the lab: its name (01_collectives ... 08_pipeline) or the shipped lab notebook")
    g.add_argument("submissions", nargs="*", type=Path,
                   help="learners' notebooks (.ipynb), or folders searched recursively for them")
    g.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write grades.html, grades.csv, grades.md, lines.csv and junit.xml here (default: ./grades; "
                        "with --self: none)")
    g.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="submissions graded at once (default 1); each runs its ranks on this machine's cores, "
                        "so N above cores/2 rarely helps")
    g.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="grade only the tasks (or verdict lines) containing TEXT (repeatable)")
    g.add_argument("--first-case", action="store_true",
                   help="grade only each task's first case (fewer world sizes): a quick pass, not the lab's marks")
    g.add_argument("--no-sandbox", action="store_true",
                   help="run submissions without bubblewrap: their code can then read your files, see your "
                        "processes and use the network (your own notebooks only)")
    g.add_argument("--backend", choices=("gloo", "auto", "nccl"), default="gloo",
                   help="backend of the graded ranks (default gloo: CPU, what every check is validated on)")
    g.add_argument("--stall", type=float, default=None, metavar="S",
                   help="seconds a case's ranks may all wait without work before it counts as hung (default 5)")
    g.add_argument("--case-cap", type=float, default=180, metavar="S",
                   help="last-resort limit on one case whose ranks keep working, in seconds (default 180)")
    g.add_argument("--cap", type=float, default=1800, metavar="S",
                   help="last-resort limit on one submission, in seconds (default 1800)")
    g.add_argument("--max-memory", type=float, default=6, metavar="GIB",
                   help="memory limit of a submission, in GiB (default 6): of each of its processes (RLIMIT_DATA) "
                        "and of all of them together (private resident memory, sampled by the grader)")
    g.add_argument("--max-procs", type=int, default=512, metavar="N",
                   help="processes and threads one submission may run at once (RLIMIT_NPROC; default 512)")
    g.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep each submission's runner log (its ranks' output) in DIR, to see why it failed")
    g.add_argument("--self", action="store_true",
                   help="a learner checking their own labs/LAB.ipynb (or the given notebook) before handing it in")
    return g


def missing_inputs(paths: list[Path]) -> str:
    """'' when every path is a notebook or a folder holding one; else a line saying what is wrong."""
    for p in paths:
        if not p.exists():
            return f"no such file or folder: {p} (give notebooks or folders of them)"
        if p.is_dir() and not any(q.suffix == ".ipynb" for q in p.rglob("*.ipynb")):
            return f"the folder {p} holds no notebook (.ipynb)"
    return ""


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
    try:
        shipped = resolve_lab(args.lab)
    except FileNotFoundError as exc:
        err(f"distlab grade: {exc}; nothing was graded")
        return 2
    if args.self and not subs:
        local = Path("labs") / shipped.name
        subs = [local if local.exists() else shipped]
    elif not subs:
        err("distlab grade: give at least one submission (a notebook or a folder of them) after the lab, "
            "e.g. `distlab grade 01_collectives submissions/`; or --self to check your own lab")
        return 2
    problem = missing_inputs(subs)
    if problem:
        err(f"distlab grade: {problem}; nothing was graded")
        return 2
    if args.jobs < 1:
        err("distlab grade: --jobs must be 1 or more")
        return 2
    out = args.out if args.out is not None or args.self else Path("grades")
    try:
        box = sandbox_for(args.no_sandbox, err)
        if args.self:
            print(f"checking {', '.join(map(str, subs))} against {args.lab}: computing the expected results...",
                  flush=True)
        lab = prepare(args.lab, args.only, first_case=args.first_case, backend=args.backend)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        err(f"distlab grade: {exc}; nothing was graded")
        return 2
    from distlab.grading.sandbox import Limits
    opts = Options(sandbox=box, stall_s=args.stall or CHECK_STALL_S, submission_cap_s=args.cap,
                   case_cap_s=args.case_cap, limits=Limits(procs=args.max_procs,
                                                           memory_bytes=int(args.max_memory * (1 << 30))),
                   backend=args.backend, keep=args.keep,
                   progress=(lambda line: print("  " + line, flush=True)) if args.self else None)
    results = grade(lab, subs, out=out, jobs=args.jobs, opts=opts,
                    echo=None if args.self else (lambda line: print(line, flush=True)))
    print(markdown(results, detail=args.self))
    if out is not None:
        print(f"wrote {out}/grades.html (the gradebook), grades.csv (one row per student), grades.md, lines.csv, "
              "junit.xml")
    if args.self:
        for r in results:
            failed = [v.check for v in r.verdicts if v.reason]
            print(f"{r.submission}: {r.score:g}/{r.max_score:g} points, {len(r.verdicts) - len(failed)}/"
                  f"{len(r.verdicts)} checks passed in {r.seconds:.0f} s"
                  + (f"; first to fix: {failed[0]}" if failed else "; ready to hand in")
                  + (f"; audit: {r.flags[0]}" if r.flags else ""))
        return 0 if all(r.score == r.max_score for r in results) else 1
    return 0
