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
from distlab.grading.grade import (Options, Result, failed, grade_answers, one_line, prepare, read_answers,
                                  run_together)
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
        results[name] = res = grade_answers(the_lab, answers, notes, name, opts)
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


def grade_together(hand_ins: list[tuple[ShippedLab, Path]], *, opts: Options | None = None) -> list[Result]:
    """One hand-in's notebooks for several labs (`(lab, notebook)` pairs), graded by ONE runner in one
    sandbox, lab after lab: one interpreter start and one fork server instead of one per notebook (a
    learner checking every lab, a course's own solutions). Nothing else changes: every lab's cases, inputs,
    audit and verdicts are its own (a lab may come more than once: each pair is judged on its own records). A
    Result per pair, in order; a notebook that cannot be read gets its one line and the others are still graded.
    Only for notebooks of one author: they share one sandbox (the test suite also grades its attacks so, each
    judged case by case, an honest hand-in last)."""
    opts = opts or Options()
    results: dict[int, Result] = {}
    parts, where = [], []
    for k, (lab, path) in enumerate(hand_ins):
        name = display_name(path)
        try:
            answers, notes = read_answers(lab, path)
        except submission.BadSubmission as exc:
            results[k] = failed(lab, name, str(exc))
            continue
        parts.append((lab, answers))
        where.append((k, name, notes))
    if parts:
        start = time.monotonic()
        try:
            judged, cpu_s = run_together(parts, "+".join(name for _, name, _ in where), opts)
        except Exception as exc:  # noqa: BLE001 - a broken run is a line per notebook, never a crash
            judged, cpu_s = [None] * len(parts), 0.0
            why = f"internal error while grading ({type(exc).__name__}: {exc}); please report it"
        for (k, name, notes), (lab, _), got in zip(where, parts, judged):
            if got is None:
                results[k] = failed(lab, name, why)
                continue
            verdicts, flags, failure = got
            results[k] = Result(name, verdicts, one_line("; ".join(notes + ([failure] if failure else []))), flags,
                                cpu_s=cpu_s / len(parts), seconds=time.monotonic() - start)
    return [results[k] for k in range(len(hand_ins))]
