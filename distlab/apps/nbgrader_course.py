"""An nbgrader course source folder from solutions/: the labs as nbgrader assignments.

    distlab nbgrader-source COURSE [--lab 01_collectives ...]     (or python -m distlab.apps.nbgrader_course)

writes `COURSE/source/<lab>/<lab>.ipynb` for each solution notebook (or the labs named) and, when there
is none yet, `COURSE/nbgrader_config.py`. Then, in COURSE, nbgrader's own commands work as usual:

    nbgrader generate_assignment 01_collectives     # release/01_collectives/: the same cells as labs/
    nbgrader autograde 01_collectives               # scores submitted/<student>/01_collectives/

Each source notebook is the lab that `distlab build-labs` writes (`checks.labs.make_lab`: the same cells,
tags and expected verdicts) with the solution's answers put back, plus nbgrader's cell metadata:

- an answer cell (its `### BEGIN SOLUTION` / `### END SOLUTION` fences are nbgrader's own) is a solution
  cell; the config makes nbgrader's stub the lab's (`raise NotImplementedError("your code here")`);
- a graded check cell (`# Graded check (do not edit)`, one `grade(...)` call) is a locked autograded test
  cell worth its verdict lines' points (`Task.points` per line, as `distlab grade` counts them). A hidden
  test region, which `generate_assignment` removes, makes the cell's value the points its lines passed
  (nbgrader's partial credit), so a check that fails two lines of six scores 4 of 6, as under `distlab grade`;
  it also shows the ranks' output of a failed check on stdout (nbgrader zeroes a test cell that writes to
  stderr);
- every other cell is locked: nbgrader restores it from the source before autograding, as `distlab grade`
  takes everything but the answer cells from the shipped lab.

nbgrader runs each hand-in in a kernel as the instructor, unsandboxed, on the package's fixed inputs: its
score is for convenience. Grade untrusted hand-ins with `distlab grade` (README, *Labs as nbgrader
assignments*).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import nbformat

from distlab.checks import lab_module
from distlab.checks.labs import BEGIN, is_check_cell, make_lab
from distlab.grading.lab import grade_calls

ROOT = Path(__file__).resolve().parents[2]
STUB = 'raise NotImplementedError("your code here")'     # what `checks.labs.strip_answers` writes

CONFIG = f'''# nbgrader's configuration for distlab's labs (written by `distlab nbgrader-source`).
c = get_config()  # noqa: F821 - nbgrader defines it
# The stub nbgrader puts in place of an answer: the one `distlab build-labs` writes, so a released
# notebook has the same cells as labs/.
c.ClearSolutions.code_stub = {{"python": {STUB!r}}}
# A check cell launches real ranks; distlab stops a hung one within seconds, so this only bounds a
# cell that keeps working (nbgrader's default, 30 s, is shorter than a full-size benchmark cell).
c.Execute.timeout = 900
'''

# Around a check cell's visible `grade(...)` line; `generate_assignment` removes both regions.
_BEFORE = ("### BEGIN HIDDEN TESTS\n"
           "from distlab.apps.nbgrader_course import points as _distlab_points, watch as _distlab_watch\n"
           "_distlab_watch()\n"
           "### END HIDDEN TESTS")
_AFTER = "### BEGIN HIDDEN TESTS\n_distlab_points({names})\n### END HIDDEN TESTS"


def _meta(grade_id: str, *, solution: bool = False, grade: bool = False, points: float = 0.0) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": not solution, "schema_version": 3,
            "solution": solution, "task": False}
    if grade:
        meta["points"] = points
    return meta


def _checked(source: str, tasks: dict) -> tuple[str, float, list[str]]:
    """A check cell's source with its hidden regions, its points, and the tasks it grades."""
    names = [name for name, _ in grade_calls(source)]
    lines = source.split("\n")
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("grade("))
    hidden = lines[:at] + [_BEFORE] + lines[at:] + [_AFTER.format(names=", ".join(map(repr, names)))]
    points = sum(tasks[n].points * len(tasks[n].lines()) for n in names)
    return "\n".join(hidden), points, names


def source_notebook(solution: nbformat.NotebookNode, lab_name: str) -> nbformat.NotebookNode:
    """nbgrader's source version of one solution notebook (see the module's docstring)."""
    tasks = lab_module(lab_name).TASKS
    nb = make_lab(solution)
    nb.metadata.get("distlab", {}).pop("generated", None)    # a hash of labs/' cells, not these
    if not nb.metadata.get("distlab", True):
        del nb.metadata["distlab"]
    for k, (cell, answer) in enumerate(zip(nb.cells, solution.cells)):
        ident = cell.get("id") or f"cell-{k}"
        if cell.cell_type == "code" and BEGIN in answer.source:
            cell.source = answer.source
            cell.metadata["nbgrader"] = _meta(f"answer-{ident}", solution=True)
        elif cell.cell_type == "code" and is_check_cell(cell) and grade_calls(cell.source):
            cell.source, points, names = _checked(cell.source, tasks)
            cell.metadata["nbgrader"] = _meta("-".join(names), grade=True, points=points)
        else:
            cell.metadata["nbgrader"] = _meta(f"{cell.cell_type}-{ident}")
    return nb


def write_course(course: Path, labs: list[str] | None = None, root: Path = ROOT) -> list[Path]:
    """Write COURSE/source/<lab>/<lab>.ipynb for each solution (or the `labs` named) and, if absent,
    COURSE/nbgrader_config.py; returns the notebooks written."""
    course = Path(course)
    solutions = sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb"))
    if labs:
        missing = set(labs) - {p.stem for p in solutions}
        if missing:
            raise SystemExit(f"no solution notebook for {sorted(missing)} in {root / 'solutions'}")
        solutions = [p for p in solutions if p.stem in labs]
    out = []
    for sol in solutions:
        target = course / "source" / sol.stem / sol.name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(source_notebook(nbformat.read(sol, as_version=4), sol.stem), target)
        out.append(target)
    config = course / "nbgrader_config.py"
    if not config.exists():
        config.write_text(CONFIG)
    return out


# ---- in the kernel, under `nbgrader autograde`: the hidden regions of a check cell call these -----------------

_passed: dict[str, float] = {}


def watch() -> None:
    """Record the points of every graded task run from now on (`points`), and send a failed check's
    rank output to stdout instead of stderr. Idempotent: wraps `checks.task.grade_task` once."""
    from distlab.checks import task as task_module
    _passed.clear()
    if getattr(task_module.grade_task, "_nbgrader_watch", False):
        return
    original = task_module.grade_task

    def grade_task(task, *answers):
        with contextlib.redirect_stderr(sys.stdout):
            lines = original(task, *answers)
        _passed[task.name] = sum(task.points for line in lines if line.ok)
        return lines

    grade_task._nbgrader_watch = True
    task_module.grade_task = grade_task


def points(*names: str) -> float:
    """The points the named tasks' verdict lines passed since `watch()` (0 for a task that did not run)."""
    return float(sum(_passed.get(n, 0.0) for n in names))


def _arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("course", type=Path, help="the nbgrader course folder (source/ is written inside it)")
    p.add_argument("--lab", action="append", help="a lab to convert (01_collectives); default: every lab")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout holding solutions/")
    return p


def add_parser(sub):
    return _arguments(sub.add_parser("nbgrader-source", help="(instructors) the labs as an nbgrader course's "
                                     "source/ folder, autograded check cells included",
                                     description="Write an nbgrader course source folder from solutions/."))


def run(args) -> int:
    for path in write_course(args.course, args.lab, args.root):
        print(f"wrote: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.apps.nbgrader_course",
                                description="Write an nbgrader course source folder from solutions/.")
    return run(_arguments(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
