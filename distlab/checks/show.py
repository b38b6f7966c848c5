"""What a check cell prints: the task's verdicts at a glance, then its lines.

    all_gather  2 ranks  3 ranks  4 ranks
      values    PASS     FAIL     -
      traffic   FAIL     FAIL     -
    PASS all_gather, 2 ranks, values: right on every rank in 12 cases
    FAIL all_gather, 2 ranks, traffic: rank 0 called all_reduce: use only send/recv
    FAIL all_gather, 3 ranks, values
    FAIL all_gather, 3 ranks, traffic
      why: hung: rank(s) [1] waited 5 s for each other; ...
    ...

A row per property, a column per case (its world size, or what its lines share: "4 stages, m=4"), PASS,
FAIL or - (not run); then every verdict line, a reason that a whole case shares printed once under it.
nbval and `distlab grade` read the lines that start with PASS or FAIL (`distlab.checks.labs`).
"""
from __future__ import annotations

import re
from typing import Any

# distlab.checks.task's Task, Case and Line, by their attributes (task.py prints through this module, which
# imports nothing back): a Task has .name and .cases(), a Case .world_size and .lines, a Line .name, .ok, .detail
Task = Case = Line = Any


def _not_run(line: Line) -> bool:
    """A line whose case was never run (after a hang, a livelock or a stub in an earlier case)."""
    return line.detail.startswith("not run") or "(not run: " in line.detail


def _row(name: str, case: Case) -> str:
    """A verdict line's row label: its name without the case's "N ranks" (a column says it)."""
    return re.sub(rf"(, )?\b{case.world_size} ranks(?=[,:]|$)", "", name, count=1).replace(" ,", ",").strip()


def _common_prefix(labels: list[str]) -> str:
    """The labels' common start, cut after a ", " or ": " (so that no word is split)."""
    start = labels[0]
    for label in labels[1:]:
        while not label.startswith(start):
            start = start[:-1]
    cut = max(start.rfind(", "), start.rfind(": "))
    return start[:cut + 2] if cut >= 0 else ""


def _columns(cases: list[Case], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Each case's column label and its rows' labels: what its rows share ("4 stages, m=4") when the cases
    differ by it, else its world size ("2 ranks"), made unique."""
    sizes = [f"{c.world_size} rank{'s' if c.world_size != 1 else ''}" for c in cases]
    heads = [_common_prefix(r) if len(r) > 1 else "" for r in rows]
    if len(cases) > 1 and len(set(heads)) > 1:
        shared = _common_prefix(heads)
        labels = [h[len(shared):].rstrip(", :") or n for h, n in zip(heads, sizes)]
        rows = [[x[len(h):] for x in r] for h, r in zip(heads, rows)]
    else:
        labels = sizes
    out: list[str] = []
    for label in labels:
        out.append(label if label not in out else f"{label} ({1 + sum(o.startswith(label) for o in out)})")
    return out, rows


def verdict_table(task: Task, lines: list[Line]) -> list[str]:
    """The task's verdicts at a glance: one row per property, one column per case, PASS / FAIL / - (not
    run). Empty for a task of a single verdict line."""
    cases = task.cases()
    if sum(len(c.lines) for c in cases) < 2 or len(lines) != sum(len(c.lines) for c in cases):
        return []
    columns, rows = _columns(cases, [[_row(n, c) for n in c.lines] for c in cases])
    cells: dict[str, dict[str, str]] = {}
    it = iter(lines)
    for col, names in zip(columns, rows):
        for name in names:
            line = next(it)
            mark = "PASS" if line.ok else "-" if _not_run(line) else "FAIL"
            cells.setdefault(name, {})[col] = mark
    keys = list(cells)
    prefix = _common_prefix(keys) if len(keys) > 1 else ""
    labels = [k[len(prefix):] or k for k in keys]
    width = max(len(task.name), *(len(label) + 2 for label in labels))
    widths = [max(len(c), 4) for c in columns]
    out = [f"{task.name:<{width}}  " + "  ".join(f"{c:<{w}}" for c, w in zip(columns, widths))]
    for key, label in zip(keys, labels):
        out.append(f"{'  ' + label:<{width}}  "
                   + "  ".join(f"{cells[key].get(c, ''):<{w}}" for c, w in zip(columns, widths)))
    return [line.rstrip() for line in out]


def verdict_text(task: Task, lines: list[Line]) -> list[str]:
    """What a check cell prints: the table, then every verdict line; a reason that every line of a case
    shares is printed once, under that case's lines."""
    out = verdict_table(task, lines)
    it = iter(lines)
    for case in task.cases():
        mine = [next(it, None) for _ in case.lines]
        mine = [line for line in mine if line is not None]
        shared = (len(mine) > 1 and not any(line.ok for line in mine)
                  and len({line.detail for line in mine}) == 1 and mine[0].detail)
        if shared:
            out += [f"FAIL {line.name}" for line in mine] + [f"  why: {mine[0].detail}"]
        else:
            out += [str(line) for line in mine]
    out += [str(line) for line in it]
    return out


def grade_doc(tasks: dict[str, Task]) -> str:
    """`help(grade)`, built from the lab's table: how to call it, then each task's call, the world sizes of its
    cases and the verdict lines it prints, case by case."""
    out = ["grade(task, *answers): run a graded task on real ranks and print its verdicts.", "",
           "Tasks (the call, the ranks its cases launch, then the verdict lines it prints):", ""]
    for name, task in tasks.items():
        sizes = sorted({c.world_size for c in task.cases()})
        ranks = ", ".join(map(str, sizes[:-1])) + (" and " if len(sizes) > 1 else "") + str(sizes[-1])
        out.append(f"grade({name!r}, {', '.join(task.answers)}): {len(task.cases())} case(s), on {ranks} "
                   f"rank{'s' if sizes != [1] else ''}")
        out += [f"    {line}" for line in task.lines()]
        out.append("")
    return "\n".join(out)
