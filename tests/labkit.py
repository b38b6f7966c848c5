"""Test helpers: a lab's answers (the solution's, or the unfilled stubs) as live objects.

    ns = answers("01_collectives")             # the solution's answer cells, executed
    ns = answers("01_collectives", stub=True)  # the lab's stubs (raise NotImplementedError)

The answer cells run in a fresh namespace after the lab's PRELUDE, exactly as
`distlab grade` runs a learner's cells: nothing from the notebook's other cells.
"""
from __future__ import annotations

import types
from pathlib import Path

import nbformat

from distlab.checks import lab_module
from distlab.checks.labs import BEGIN, END, strip_answers

ROOT = Path(__file__).resolve().parents[1]


def answer_sources(lab: str, *, stub: bool = False) -> list[str]:
    """The solution's answer cells (fence lines dropped), or their stubbed versions."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    out = []
    for cell in nb.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            if stub:
                out.append(strip_answers(cell.source))
            else:
                out.append("\n".join(l for l in cell.source.splitlines() if l.strip() not in (BEGIN, END)))
    return out


def answers(lab: str, *, stub: bool = False, replace: dict[str, str] | None = None) -> types.SimpleNamespace:
    """Execute PRELUDE + the answer cells; `replace` maps a name to source that redefines it afterwards."""
    module = lab_module(lab)
    ns: dict = {"__name__": f"answers_{lab}"}
    exec(compile(module.PRELUDE, "<prelude>", "exec"), ns)  # noqa: S102 - test fixture
    for i, src in enumerate(answer_sources(lab, stub=stub)):
        exec(compile(src, f"<answer cell {i}>", "exec"), ns)  # noqa: S102
    for name, src in (replace or {}).items():
        exec(compile(src, f"<replaced {name}>", "exec"), ns)  # noqa: S102
    return types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})


def run(lab: str, task: str, ns: types.SimpleNamespace):
    """Every verdict line of one task for the answers in `ns`."""
    from distlab.checks import run_task
    t = lab_module(lab).TASKS[task]
    return run_task(t, [getattr(ns, name) for name in t.answers])


def strings(lines) -> list[str]:
    """Verdict lines as the learner reads them."""
    return [str(line) for line in lines]


def only(task, world_size: int = 2):
    """`task` restricted to its `world_size`-rank case(s) (a copy; the task itself is unchanged)."""
    return with_cases(task, [c for c in task.cases() if c.world_size == world_size])


def with_cases(task, cases):
    """A copy of `task` that runs `cases` (some of its own) instead of all of them."""
    import copy
    import dataclasses
    if dataclasses.is_dataclass(task):          # a row of a chapter's table (checks.task.Row)
        return dataclasses.replace(task, case_list=tuple(cases))
    t = copy.copy(task)                         # a Task subclass
    t.cases = lambda: list(cases)
    return t


def task_lines(task, ns: types.SimpleNamespace) -> list[str]:
    """Every verdict line of `task` (a Task object, perhaps `only(...)`) for the answers in `ns`."""
    from distlab.checks import run_task
    return strings(run_task(task, [getattr(ns, a) for a in task.answers]))


def case_lines(task, ns: types.SimpleNamespace, n: int) -> list[str]:
    """The verdict lines of `task`'s case on `n` ranks only, judged as `run_task` judges them."""
    from distlab.checks.task import launch_exercise, reference_of, validate
    case = next(c for c in task.cases() if c.world_size == n)
    outputs = launch_exercise(task, case, tuple(getattr(ns, a) for a in task.answers))
    validate(outputs)
    return strings(task.judge(case, outputs, reference_of(task, case)))
