"""Chapter 1's graded checks catch wrong and cheating answers, not only missing ones.

The generic lab test (tests/test_labs.py) shows an unfilled lab fails every check.
Here the solution notebook is run with Task 3 replaced by
- an answer that calls the library's all-reduce: values PASS, traffic must FAIL;
- an answer that forgets the reduce-scatter: values must FAIL.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from distlab.labs import is_check_cell

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "01_collectives.ipynb"

CHEAT = '''
def ring_all_reduce(tensor, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op)
    return tensor
'''
HALF = '''
def ring_all_reduce(tensor, op=dist.ReduceOp.SUM):
    ring_all_gather(tensor)
    return tensor
'''


def _run_with_task3(answer: str, tmp_path: Path) -> str:
    """Execute setup, helpers, Tasks 1-2 and the Task 3 check with `answer` as Task 3; its stdout."""
    nb = nbformat.read(SOLUTION, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    defs = {name: next(c for c in code if f"def {name}(" in c.source and not is_check_cell(c))
            for name in ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")}
    harness = next(c for c in code if is_check_cell(c) and "def grade(" in c.source)
    task3_check = next(c for c in code if is_check_cell(c) and 'grade("all_reduce"' in c.source)
    defs["ring_all_reduce"].source = answer
    # The harness cell also grades Task 1; cut that call, keep its definitions.
    harness.source = harness.source.replace('grade("reduce_scatter", ring_reduce_scatter)', "")
    cells = [code[0], code[1], defs["ring_reduce_scatter"], defs["ring_all_gather"], harness,
             defs["ring_all_reduce"], task3_check]
    run = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    NotebookClient(run, timeout=300, kernel_name="python3", allow_errors=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return "".join(o.get("text", "") for o in run.cells[-1].outputs if o.get("output_type") == "stream")


@pytest.mark.parametrize("answer, expected", [
    (CHEAT, ["PASS all_reduce, 2 ranks, values", "FAIL all_reduce, 2 ranks, traffic: rank 0 called all_reduce"]),
    (HALF, ["FAIL all_reduce, 3 ranks, values", "FAIL all_reduce, 4 ranks, traffic: rank 0 sent"]),
], ids=["calls-library-all-reduce", "skips-reduce-scatter"])
def test_task3_check_rejects_wrong_answers(answer, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_QUICK", "1")
    out = _run_with_task3(answer, tmp_path)
    for line in expected:
        assert line in out, f"expected {line!r} in the check output:\n{out}"
    assert "PASS all_reduce, 4 ranks, traffic" not in out, out
