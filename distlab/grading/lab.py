"""What a shipped lab grades: its tasks, the answer names each takes, its answer cells.

Read from the shipped lab notebook (`labs/NN_topic.ipynb`) without executing
anything: each graded check cell is a line like

    grade("reduce_scatter", ring_reduce_scatter)

parsed with `ast` to get the task and the learner's names it is called with;
the answer cells (tag `answer`) give their cell ids and the names they
define. The tasks themselves (cases, exercise, reference, judge) come from
the lab's check module (`distlab.checks.lab_module`). Expected verdict lines
are never read: verdicts are computed by `Task.judge`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import nbformat

from distlab.checks import lab_module
from distlab.checks.task import Task
from distlab.checks.labs import ANSWER_TAG, is_check_cell

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Graded:
    """One task the lab grades, called with the learner's `names`; `cases` are the indices graded."""

    task: Task
    names: tuple[str, ...]
    cases: tuple[int, ...] = ()

    @property
    def lines(self) -> list[str]:
        all_cases = self.task.cases()
        return [line for i in self.cases for line in all_cases[i].lines]


@dataclass
class ShippedLab:
    name: str                                   # '01_collectives'
    path: Path
    module: ModuleType
    graded: list[Graded] = field(default_factory=list)
    answer_cells: list[tuple[str, list[str]]] = field(default_factory=list)   # (cell id, names it defines)
    references: dict = field(default_factory=dict)   # (task, case index) -> reference, when drawn secretly
    inputs: dict = field(default_factory=dict)       # (task, case index) -> each rank's secret inputs (safetensors)
    work_caps: dict = field(default_factory=dict)    # (task, case index) -> livelock bound, CPU s per rank

    def select(self, only: list[str] | None) -> "ShippedLab":
        """Keep the tasks whose name contains one of `only`, and the cases of other tasks one of
        whose verdict lines contains one of `only` ('reduce_scatter, 2 ranks')."""
        if not only:
            return self
        kept = []
        for g in self.graded:
            if any(s in g.task.name for s in only):
                kept.append(g)
                continue
            cases = tuple(i for i, case in enumerate(g.task.cases()) if any(s in line for line in case.lines
                                                                              for s in only))
            if cases:
                kept.append(Graded(g.task, g.names, cases))
        if not kept:
            raise ValueError(f"no graded task or verdict line of {self.name} matches {only}")
        self.graded = kept
        return self


    def first_cases(self) -> "ShippedLab":
        """Keep each task's first graded case only (a quick pass: every task, fewer world sizes)."""
        self.graded = [Graded(g.task, g.names, g.cases[:1]) for g in self.graded]
        return self


def defined_names(source: str) -> list[str]:
    """Top-level functions and classes a cell defines ([] when it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def grade_calls(source: str) -> list[tuple[str, list[str]]]:
    """The `grade("task", name, ...)` calls of a check cell: [(task, [names])]."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "grade"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [a.id for a in node.args[1:] if isinstance(a, ast.Name)]
            if len(names) == len(node.args) - 1:
                out.append((node.args[0].value, names))
    return out


def resolve_lab(lab: str | Path) -> Path:
    """`01_collectives`, `labs/01_collectives.ipynb` or any path to a shipped lab."""
    p = Path(lab)
    if p.suffix == ".ipynb" and p.exists():
        return p
    for cand in (ROOT / "labs" / f"{lab}.ipynb", Path("labs") / f"{lab}.ipynb"):
        if cand.exists():
            return cand
    hits = sorted((ROOT / "labs").glob(f"*{lab}*.ipynb"))
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(sorted(q.stem for q in (ROOT / "labs").glob("*.ipynb"))) or "none"
    raise FileNotFoundError(f"no shipped lab called {lab!r} in {ROOT / 'labs'} (labs: {known})")


def load_lab(lab: str | Path) -> ShippedLab:
    """The shipped lab's graded tasks and answer cells; ValueError when it grades nothing."""
    path = resolve_lab(lab)
    try:
        module = lab_module(path.stem)
    except (KeyError, ModuleNotFoundError) as exc:
        raise ValueError(f"{path.name}: no check module for this lab yet ({exc})") from None
    nb = nbformat.read(path, as_version=4)
    out = ShippedLab(path.stem, path, module)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if ANSWER_TAG in cell.get("metadata", {}).get("tags", []):
            out.answer_cells.append((cell.get("id", ""), defined_names(cell.source)))
        elif is_check_cell(cell):
            for task_name, names in grade_calls(cell.source):
                if task_name not in module.TASKS:
                    raise ValueError(f"{path.name}: a check cell grades {task_name!r}, which "
                                     f"{module.__name__} does not define (tasks: {sorted(module.TASKS)})")
                task = module.TASKS[task_name]
                out.graded.append(Graded(task, tuple(names), tuple(range(len(task.cases())))))
    if not out.graded:
        raise ValueError(f"{path} has no graded check cell (a cell tagged nbval-check-output calling grade(...))")
    return out
