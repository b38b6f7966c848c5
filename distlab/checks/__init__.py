"""Graded checks: one module per lab (`distlab.checks.ch01` ...); a check cell is one line; labs (the lab notebooks' format).
May import: engine, theory, meters, bench, course, and the top-level `distlab` (what the labs' code types).
Chapter NN's checks are chNN; what they build on is the chapter's topic in `distlab.course` (README: the layers).

    from distlab.checks.ch01 import grade
    grade("reduce_scatter", ring_reduce_scatter)
    PASS reduce_scatter, 2 ranks, values: matches torch.distributed in 24 cases

Each lab module defines `TASKS` (name -> `Task`: its table, `table(task(name,
answers, per_ranks(sizes, *verdict lines), exercise=..., judge=...), ...)`,
the lab's spec read top to bottom; `help(grade)` prints it), `PRELUDE` (the
imports the lab's answer cells may rely on, which its setup cell holds
verbatim) and `grade`; optionally `RANK_IMPORTS`, what its ranks import, which `distlab grade`
preloads instead of `distlab.launch`'s list (lab 1: no torch._dynamo, no FSDP). The verdicts are computed where they are printed, from the ranks'
raw outputs (see `distlab.checks.task`), so `distlab grade` reuses them.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from distlab.checks.task import Case, Line, Task, check_line, grade_task, run_task, validate
from distlab.checks.verdict import CheckFailed, check, compare, expect, reason

# Lab name (the notebook's stem) -> the module holding its tasks.
LABS = {
    "01_collectives": "distlab.checks.ch01",
    "02_ddp": "distlab.checks.ch02",
    "03_zero1": "distlab.checks.ch03",
    "04_zero2": "distlab.checks.ch04",
    "05_zero3": "distlab.checks.ch05",
    "06_fsdp": "distlab.checks.ch06",
    "07_tensor_parallel": "distlab.checks.ch07",
    "08_pipeline": "distlab.checks.ch08",
    "09_training": "distlab.checks.ch09",
    "10_moe": "distlab.checks.ch10",
}


def lab_module(lab: str) -> ModuleType:
    """The check module of a lab, by its name ('01_collectives')."""
    if lab not in LABS:
        raise KeyError(f"no graded lab called {lab!r}; labs: {sorted(LABS)}")
    return importlib.import_module(LABS[lab])


__all__ = ["Case", "Line", "Task", "grade_task", "check_line", "run_task", "validate",
           "CheckFailed", "check", "compare", "expect", "reason", "LABS", "lab_module"]
