"""Chapter 5's graded checks catch wrong ZeRO-3 answers, not only missing ones.

The generic lab test (tests/test_labs.py) shows an unfilled lab fails every check. Here the
solution's `ZeRO3` is run with one deliberate bug at a time:
- it keeps the gathered unit after forward (no free, so no second all-gather): traffic must FAIL;
- it sums gradients over ranks instead of averaging them: parameters must FAIL.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from distlab.labs import is_check_cell

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "05_zero3.ipynb"

KEEP_AFTER_FORWARD = ("        self._free(unit)\n        # Backward reaches", "        # Backward reaches")
SUM_NOT_MEAN = ("        flat.div_(self.n)", "        pass")


def _checks_with_bug(bug: tuple[str, str], tmp_path: Path) -> str:
    nb = nbformat.read(SOLUTION, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    zero3 = next(c for c in code if "class ZeRO3(" in c.source)
    assert bug[0] in zero3.source, "the solution changed: update this test's bug"
    zero3.source = zero3.source.replace(bug[0], bug[1])
    units = next(c for c in code if "def block_units(" in c.source)
    harness = next(c for c in code if "def exercise(" in c.source)
    checks = [c for c in code if is_check_cell(c) and ("check_matches_single" in c.source or "check_traffic" in c.source)]
    for c in checks:
        c.outputs = []
    run = nbformat.v4.new_notebook(cells=[code[0], units, zero3, harness, *checks], metadata=nb.metadata)
    NotebookClient(run, timeout=300, kernel_name="python3", allow_errors=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return "".join(o.get("text", "") for c in run.cells[-len(checks):] for o in c.outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


@pytest.mark.parametrize("bug, failing, passing", [
    (KEEP_AFTER_FORWARD, "FAIL ZeRO3, 2 ranks: traffic per step", "PASS ZeRO3, 2 ranks, per-block units:"),
    (SUM_NOT_MEAN, "FAIL ZeRO3, 2 ranks, per-block units:", "PASS ZeRO3, 2 ranks: traffic per step"),
], ids=["keeps-unit-after-forward", "sums-gradients"])
def test_checks_reject_wrong_zero3(bug, failing, passing, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_QUICK", "1")
    out = _checks_with_bug(bug, tmp_path)
    assert failing in out, f"expected {failing!r} in:\n{out}"
    assert passing in out, f"expected {passing!r} in:\n{out}"
