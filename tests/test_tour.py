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
