"""A pytest plugin (loaded automatically with distlab): nbval compares a lab's check cells
with the verdicts kept in their metadata.

A lab shows no verdict before the learner works, so its graded check cells
have no outputs; the solution's verdict lines sit in
`metadata.distlab.expected` (see `distlab.labs.make_lab`). nbval compares a
cell only with its stored outputs, so before the cells run this plugin gives
each such cell those lines as its stored output:

    pytest --nbval-lax labs/01_collectives.ipynb    # passes once every check prints PASS
"""
from __future__ import annotations

from typing import Any


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    import nbformat

    from distlab.labs import expected_lines, is_check_cell
    for item in items:
        cell = getattr(item, "cell", None)
        if type(item).__name__ != "IPyNbCell" or cell is None or not hasattr(cell, "get"):
            continue
        expected = expected_lines(cell)
        if is_check_cell(cell) and expected and not cell.get("outputs"):
            cell["outputs"] = [nbformat.v4.new_output("stream", name="stdout", text="\n".join(expected) + "\n")]
            cell["execution_count"] = cell.get("execution_count") or 1
