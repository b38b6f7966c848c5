"""One GPU means N = 1: what the tour and `distlab doctor --gpu` run there must not divide by zero.

On a 1-GPU machine both set DISTLAB_WORLD_SIZE=1 for every notebook. At N = 1 a ring sends nothing,
(N-1)/N x S is 0 and busbw is 0 for every implementation, so a ratio to theory or to the library
does not exist; the notebooks must say so instead of raising ZeroDivisionError.
"""
import json
from pathlib import Path

import pytest

from distlab.apps.cluster import _vs_theory

ROOT = Path(__file__).resolve().parents[1]


def _run_measurement_cells(notebook: Path) -> str:
    """Every code cell but the graded checks (they pick their own world sizes), in this process, as a kernel
    would run them (`__name__` is `__main__`, so rank functions travel by value); returns what they printed."""
    import contextlib
    import io
    nb = json.loads(notebook.read_text())
    ns: dict = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code" or "nbval-check-output" in cell["metadata"].get("tags", []):
                continue
            exec(compile("".join(cell["source"]), f"{notebook.name} cell {i}", "exec"), ns)   # noqa: S102
    return out.getvalue()


@pytest.mark.filterwarnings("error::UserWarning")     # e.g. a log axis over nothing but zeros
def test_solution_01_measures_on_one_rank(monkeypatch, tmp_path, no_orphans):
    monkeypatch.setenv("DISTLAB_WORLD_SIZE", "1")
    monkeypatch.setenv("DISTLAB_QUICK", "1")
    monkeypatch.setenv("DISTLAB_RESULTS", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    printed = _run_measurement_cells(ROOT / "solutions" / "01_collectives.ipynb")
    assert "on 1 ranks; (N-1)/N x S = 0" in printed
    assert "reduce-scatter sent 0, all-gather sent 0 (one rank: no peer)" in printed
    assert "busbw is 0 on one rank, so there is no ratio" in printed
    assert not (tmp_path / "ring_ratio.jsonl").exists()       # no ratio recorded where none exists


@pytest.mark.parametrize("measured, predicted, says", [
    (4096, 4096, "1.0000x theory"), (0, 0, "theory: 0 on one rank"), (8, 0, "theory: 0, yet 8 B were sent")])
def test_the_cluster_job_compares_with_theory_on_one_rank(measured, predicted, says):
    assert _vs_theory(measured, predicted) == says
