"""`distlab grade`: grade a class's lab notebooks against the shipped lab's checks.

    distlab grade 01_collectives submissions/ --out grades/
    distlab grade --self 01_collectives          # a learner, on labs/01_collectives.ipynb

For each submission: take the learner's answer cells, rebuild the notebook from
the shipped lab (its own setup and check cells, its committed verdicts), run it
in a fresh worker + kernel with the answers executed on the ranks only
(`distlab.grading.remote`), and score each graded verdict line: it earns its
points when the expected `PASS ...` line is printed exactly. Points come from a
check cell's `metadata.distlab.points` (per verdict line of that cell, default
1). Writes grades.csv, grades.md and junit.xml to --out.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from distlab.grading.build import Lab, build, extract_answers, load_lab, read_submission
from distlab.grading.report import audit, write_reports
from distlab.grading.worker import run_isolated
from distlab.labs import is_check_cell


@dataclass
class Verdict:
    check: str
    points: float
    max_points: float
    reason: str = ""          # one line, empty when passed


@dataclass
class Result:
    submission: str
    verdicts: list = field(default_factory=list)
    note: str = ""            # one line about the whole submission (invalid JSON, timeout, ...)
    flags: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(v.points for v in self.verdicts)

    @property
    def max_score(self) -> float:
        return sum(v.max_points for v in self.verdicts)


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _fail_reason(expected: str, lines: list[str]) -> str | None:
    """The reason of the FAIL line (or differing PASS line) printed for `expected`'s check."""
    want = expected[5:]
    best, best_len = None, -1
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind not in ("PASS", "FAIL"):
            continue
        pos = rest.find(": ")
        while pos != -1:
            name = rest[:pos]
            if (want == name or want.startswith(name + ": ")) and len(name) > best_len:
                detail = rest[pos + 2:]
                best = detail if kind == "FAIL" else f"passed with a different result: {detail}"
                best_len = len(name)
            pos = rest.find(": ", pos + 1)
        if kind == "FAIL" and want == rest and len(rest) > best_len:
            best, best_len = "failed", len(rest)
    return best


def _cell_error(cell, cell_timeout: float) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            if out.get("ename") in ("KeyboardInterrupt", "CellTimeoutError"):
                return f"timed out: the check cell ran past {cell_timeout:g} s and was interrupted"
            value = str(out.get("evalue", "")).strip().splitlines()
            return f"the check cell raised {out.get('ename')}: {value[-1] if value else ''}"
    return None


def score(lab: Lab, executed, note: str, cell_timeout: float) -> list[Verdict]:
    """One Verdict per expected verdict line of the shipped lab."""
    cells = {} if executed is None else {c.metadata.get("distlab_check_index"): c for c in executed.cells
                                         if c.cell_type == "code" and is_check_cell(c)}
    out = []
    for chk in lab.checks:
        cell = cells.get(chk.cell)
        if cell is None or cell.get("execution_count") is None and not cell.outputs:
            out.append(Verdict(chk.name, 0, chk.points, _one_line(f"not run: {note or 'an earlier cell stopped the notebook'}")))
            continue
        text = "".join(o.get("text", "") for o in cell.outputs
                       if o.get("output_type") == "stream" and o.get("name") == "stdout")
        lines = [line for line in text.splitlines() if line.strip()]
        if chk.expected in lines:
            out.append(Verdict(chk.name, chk.points, chk.points))
            continue
        reason = (_fail_reason(chk.expected, lines) or _cell_error(cell, cell_timeout)
                  or (f"no verdict printed ({note})" if note else "no verdict printed"))
        out.append(Verdict(chk.name, 0, chk.points, _one_line(reason)))
    return out


def grade_one(lab: Lab, path: Path, *, cell_timeout: float, rank_timeout: float,
              total_timeout: float | None = None, name: str | None = None, keep: Path | None = None) -> Result:
    start = time.monotonic()
    res = Result(name or _display(path))
    sub, why = read_submission(path)
    if sub is None:
        res.note = why
        res.verdicts = [Verdict(c.name, 0, c.points, _one_line(why)) for c in lab.checks]
        return res
    answers, missing = extract_answers(lab, sub)
    res.flags = audit("\n".join(src for _, src in answers))
    notes = list(missing)
    if keep is not None:   # the graded notebook stays for a look (or `pytest --nbval-lax` on it)
        workdir = Path(keep) / f"{Path(path).stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:6]}"
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="distlab-grade-"))
    try:
        nb = build(lab, answers, workdir, rank_timeout)
        n_cells = sum(1 for c in nb.cells if c.cell_type == "code")
        total = total_timeout or cell_timeout * n_cells + 60
        executed, run_note = run_isolated(nb, workdir, cell_timeout, total)
        if keep is not None and executed is not None:
            nbformat.write(executed, workdir / "executed.ipynb")
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if run_note:
        notes.append(run_note)
    res.note = _one_line("; ".join(notes))
    res.verdicts = score(lab, executed, run_note, cell_timeout)
    res.seconds = time.monotonic() - start
    return res


def _display(path: Path) -> str:
    """The path relative to the current folder when under it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def expand(submissions: list[Path]) -> list[tuple[Path, str]]:
    """(path, name in the report): files as given; folders -> their .ipynb files (checkpoints skipped)."""
    out = []
    for p in submissions:
        p = Path(p)
        if p.is_dir():
            for q in sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts):
                out.append((q, str(Path(p.resolve().name) / q.relative_to(p))))
        else:
            out.append((p, _display(p)))
    return out


def grade(lab: str | Path, submissions: list[Path], *, out: Path | None = None, cell_timeout: float = 300,
          rank_timeout: float = 60, total_timeout: float | None = None, jobs: int = 1,
          only: list[str] | None = None, keep: Path | None = None, echo: bool = True) -> list[Result]:
    """Grade every submission (in order, `jobs` at a time); write reports to `out` if given."""
    the_lab = load_lab(lab).select(only)
    paths = expand(submissions)

    def one(item: tuple[Path, str]) -> Result:
        r = grade_one(the_lab, item[0], cell_timeout=cell_timeout, rank_timeout=rank_timeout,
                      total_timeout=total_timeout, keep=keep, name=item[1])
        if echo:
            print(f"{r.submission}: {r.score:g}/{r.max_score:g}" + (f"  ({r.note})" if r.note else ""), flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, paths))
    if out is not None:
        write_reports(results, Path(out), lab=str(the_lab.path))
    return results


def main(args) -> int:
    """The `distlab grade` subcommand (see distlab/cli.py)."""
    from distlab.grading.report import markdown
    subs = list(args.submissions)
    if args.self:
        if not subs:
            try:
                subs = [Path("labs") / load_lab(args.lab).path.name]
            except (FileNotFoundError, ValueError) as exc:
                print(f"distlab grade: {exc}", file=sys.stderr)
                return 2
    elif not subs:
        print("distlab grade: give at least one submission (a notebook or a folder), or --self", file=sys.stderr)
        return 2
    try:
        results = grade(args.lab, subs, out=args.out, cell_timeout=args.timeout, rank_timeout=args.rank_timeout,
                        jobs=args.jobs, only=args.only, keep=args.keep, echo=not args.self)
    except (FileNotFoundError, ValueError) as exc:   # no such lab, a lab without checks, --only matching nothing
        print(f"distlab grade: {exc}", file=sys.stderr)
        return 2
    print(markdown(results, detail=args.self))
    if args.out is not None:
        print(f"wrote {args.out}/grades.csv, grades.md, junit.xml")
    if args.self:
        return 0 if all(r.score == r.max_score for r in results) else 1
    return 0
