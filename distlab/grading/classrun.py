"""A class run: every submission of a folder, `jobs` at a time; reports always written.

Submissions whose answer cells are identical (the unfilled lab handed in
twice, a copied notebook, a lab whose check cells were edited or deleted but
whose answers are the same) are graded once: the others get the same lines
and a note naming the first one ("same answer cells as ...").
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from distlab.grading import submission
from distlab.grading.grade import Options, Result, failed, one_line, prepare, read_answers, run_answers
from distlab.grading.lab import ShippedLab


def display_name(path: Path) -> str:
    """The path relative to the current folder when under it, else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def expand(submissions: list[Path]) -> list[tuple[Path, str]]:
    """(path, name in the report): files as given; folders -> their .ipynb files (checkpoints skipped)."""
    out = []
    for p in map(Path, submissions):
        if p.is_dir():
            for q in sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts):
                out.append((q, str(Path(p.resolve().name) / q.relative_to(p))))
        else:
            out.append((p, display_name(p)))
    return out


def grade(lab: str | Path | ShippedLab, submissions: list[Path], *, out: Path | None = None, jobs: int = 1,
          only: list[str] | None = None, opts: Options | None = None,
          echo: Callable[[str], None] | None = None) -> list[Result]:
    """Grade every submission (in order in the report); write grades.csv, grades.md, junit.xml to `out`."""
    from distlab.grading.report import write_reports
    the_lab = lab if isinstance(lab, ShippedLab) else prepare(lab, only)
    opts = opts or Options()
    items = expand(submissions)
    results: dict[str, Result] = {}
    first: dict[str, str] = {}                      # answer cells -> the first submission with them
    todo: list[tuple[str, list, list[str]]] = []    # (name, answers, notes) to run
    same: dict[str, tuple[str, list[str]]] = {}     # name -> (first name, notes)
    for path, name in items:
        try:
            answers, notes = read_answers(the_lab, path)
        except submission.BadSubmission as exc:
            results[name] = failed(the_lab, name, str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - one broken submission never stops the class
            results[name] = failed(the_lab, name, f"internal error while reading ({type(exc).__name__}: {exc})")
            continue
        key = repr(answers)
        if key in first:
            same[name] = (first[key], notes)
        else:
            first[key] = name
            todo.append((name, answers, notes))

    def one(item: tuple[str, list, list[str]]) -> None:
        name, answers, notes = item
        start = time.monotonic()
        try:
            verdicts, flags, failure, cpu_s = run_answers(the_lab, answers, name, opts)
            res = Result(name, verdicts, one_line("; ".join(notes + ([failure] if failure else []))), flags,
                         cpu_s=cpu_s)
        except Exception as exc:  # noqa: BLE001 - one broken submission never stops the class
            res = failed(the_lab, name, f"internal error while grading ({type(exc).__name__}: {exc}); "
                                        "please report it")
        res.seconds = time.monotonic() - start
        results[name] = res
        if echo is not None:
            echo(f"{name}: {res.score:g}/{res.max_score:g} in {res.seconds:.0f} s"
                 + (f"  ({res.note})" if res.note else ""))

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(one, todo))
    finally:
        for name, (original, notes) in same.items():
            if original in results:
                done = results[original]
                results[name] = Result(name, list(done.verdicts), one_line("; ".join(
                    notes + [f"same answer cells as {original} (graded once)"])), list(done.flags))
        ordered = [results.get(name) or Result(name, note="not graded: the run was interrupted")
                   for _, name in items]
        if out is not None:
            write_reports(ordered, Path(out), lab=the_lab.name)
    return ordered
