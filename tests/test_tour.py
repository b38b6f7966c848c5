"""The tour writes a summary of measurements with the documented keys."""
import json
import subprocess
import sys

import pytest

from distlab.tour import sweep_sizes


def test_sweep_sizes_cover_the_issue_ranges():
    assert sweep_sizes(False, False)[0] == 1024 and sweep_sizes(False, False)[-1] == 64 * 2 ** 20
    assert sweep_sizes(False, True)[-1] == 2 ** 30
    assert sweep_sizes(True, False)[-1] <= 4 * 2 ** 20


def test_tour_quick_without_notebooks(tmp_path, no_orphans):
    out = subprocess.run([sys.executable, "-m", "distlab.cli", "tour", "--quick", "--skip-notebooks",
                          "--world-size", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    m = summary["machine"]
    assert {"backend", "device_kind", "device_count", "torch_version", "cpu_count"} <= set(m)
    assert [r["world_size"] for r in summary["launcher"]] == [2]
    rec = summary["launcher"][0]
    assert 0 < rec["relaunch_s"] < rec["first_launch_s"] + 5
    ops = {r["op"] for r in summary["collectives"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    for r in summary["collectives"]:
        assert set(r) == {"op", "impl", "world_size", "bytes", "seconds", "algbw_GBps", "busbw_GBps"}
        assert r["seconds"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
    assert (tmp_path / "collectives_busbw.png").stat().st_size > 1000
    assert "## Launcher" in (tmp_path / "report.md").read_text()


def test_memory_vs_n_figure_needs_several_world_sizes():
    from distlab.tour import _memory_vs_n
    rec = lambda n: {"name": "zero1", "world_size": n,  # noqa: E731
                     "model_state_bytes": {"params": 4e6, "optimizer_state": 12e6 / n},
                     "predicted_model_state_bytes": {"params": 4e6, "optimizer_state": 12e6 / n}}
    assert _memory_vs_n([rec(2)]) is None
    fig = _memory_vs_n([rec(1), rec(2), rec(4)])
    measured = [l for l in fig.axes[0].lines if l.get_marker() == "o"][0]
    assert list(measured.get_xdata()) == [1, 2, 4]
    assert list(measured.get_ydata()) == [16e6 / 2**20, 10e6 / 2**20, 7e6 / 2**20]


def test_figures_accept_a_prediction_given_as_a_total(tmp_path):
    from distlab.tour import _figures
    rec = {"name": "ddp", "world_size": 2, "model_state_bytes": {"params": 4, "grads": 4, "optimizer_state": 8},
           "predicted_model_state_bytes": 16, "samples_per_s": 10.0}
    made = _figures({"machine": {"backend": "gloo"}, "strategies": [rec]}, tmp_path)
    assert made == ["strategies_memory.png", "strategies_throughput.png"]
    assert all((tmp_path / f).stat().st_size > 1000 for f in made)
