"""The ZeRO memory calculator: pure table arithmetic, largest model per stage, and the widget's first drawing."""
from __future__ import annotations

import pytest

from distlab.theory import zero_memory_per_device
from distlab.widgets import GB, largest_models, markdown_table, memory_calculator, zero_table


def test_defaults_reproduce_the_zero_paper_example():
    rows = zero_table()  # 7.5B parameters, 64 devices, mixed-precision Adam (K = 12)
    assert [round(r.bytes_per_device / GB, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    assert [r.stage for r in rows] == [0, 1, 2, 3]


def test_components_follow_the_stage():
    psi, n = 1e9, 8
    d, z1, z2, z3 = zero_table(psi, n)
    assert (d.params_bytes, d.grads_bytes, d.optimizer_bytes) == (2 * psi, 2 * psi, 12 * psi)
    assert (z1.params_bytes, z1.grads_bytes, z1.optimizer_bytes) == (2 * psi, 2 * psi, 12 * psi / n)
    assert (z2.params_bytes, z2.grads_bytes, z2.optimizer_bytes) == (2 * psi, 2 * psi / n, 12 * psi / n)
    assert (z3.params_bytes, z3.grads_bytes, z3.optimizer_bytes) == (2 * psi / n, 2 * psi / n, 12 * psi / n)
    for r in (d, z1, z2, z3):
        assert r.bytes_per_device == pytest.approx(zero_memory_per_device(psi, n, r.stage))


def test_fp32_recipe_and_k_override():
    (row,) = zero_table(1e6, 4, recipe="fp32", stages=(3,))
    assert row.bytes_per_device == pytest.approx(16e6 / 4)  # 4 + 4 + 8 bytes per parameter
    (row,) = zero_table(1e6, 1, k=0, stages=(0,))
    assert row.bytes_per_device == pytest.approx(4e6)       # plain SGD, no optimizer state
    with pytest.raises(ValueError, match="recipe"):
        zero_table(1e6, 4, recipe="fp8")


def test_largest_model_fills_the_device_exactly():
    fit = largest_models(80 * GB, 64)
    for stage, psi in fit.items():
        assert zero_memory_per_device(psi, 64, stage) == pytest.approx(80 * GB)
    assert fit[0] == pytest.approx(5e9) and fit[3] == pytest.approx(320e9)
    assert fit[0] < fit[1] < fit[2] < fit[3]
    with pytest.raises(ValueError):
        largest_models(0, 8)


def test_markdown_table_lists_every_stage_with_its_total():
    md = markdown_table(zero_table(), device_bytes=80 * GB)
    lines = md.splitlines()
    assert len(lines) == 2 + 4
    assert "**120.0**" in lines[2] and "**31.4**" in lines[3] and "**16.6**" in lines[4] and "**1.9**" in lines[5]
    assert lines[2].endswith("5B |") and lines[5].endswith("320B |")


def test_widget_builds_and_draws_once_without_a_frontend():
    pytest.importorskip("ipywidgets")
    import matplotlib
    matplotlib.use("Agg")
    box = memory_calculator()
    assert box.children  # sliders and the output area exist
