"""The memory calculator: pure table arithmetic, largest model per stage, activations and TP, and the widget:
its default on a slider step (7.5B, not 7.94B) and a static fallback that is not `VBox(children=...)`."""
from __future__ import annotations

import pytest

from distlab.theory import zero_memory_per_device
from distlab.viz.widgets import GB, largest_models, markdown_table, memory_calculator, zero_table


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


# ---- issue 12: the calculator opens on the promised numbers; issue 13: activations and TP ----------------

def _calculator():
    pytest.importorskip("ipywidgets")
    import matplotlib
    matplotlib.use("Agg")
    return memory_calculator()


def test_the_default_lands_on_a_slider_step_and_gives_the_zero_paper_table():
    box = _calculator()
    psi = box.controls["params"]
    assert psi.value == 7.5e9                                       # not snapped to 7.94B
    assert 7.5e9 in [v for _, v in psi.options] and psi.label == "7.5B"
    rows, *_ = box.state()
    assert [round(r.bytes_per_device / GB, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]


def test_every_numeric_default_is_on_its_slider_step():
    box = _calculator()
    for name, control in box.controls.items():
        if hasattr(control, "step") and hasattr(control, "min"):
            steps = (control.value - control.min) / control.step
            assert abs(steps - round(steps)) < 1e-9, f"{name}: {control.value} is not on a step of {control.step}"
        if hasattr(control, "options"):
            values = [o[1] if isinstance(o, tuple) else o for o in control.options]
            assert control.value in values, name


def test_a_run_that_cannot_render_widgets_shows_the_table_not_vbox():
    bundle = _calculator()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle          # the live widget, where it can render
    assert not bundle["text/plain"].startswith("VBox")
    assert "DDP (stage 0) 120.0 GB" in bundle["text/plain"] and "ZeRO-3 / FSDP 1.9 GB" in bundle["text/plain"]
    assert "<table>" in bundle["text/html"] and "<b>120.0</b>" in bundle["text/html"]


def test_activations_and_a_tp_degree():
    from distlab.theory.tensor_parallel import activation_bytes_per_layer
    from distlab.viz.widgets import Activations, tp_table
    act = Activations()                                  # S 2048, b 1, h 4096, 36 layers, 32 heads
    per_layer = 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert act.bytes_per_device(1) == pytest.approx(36 * per_layer)
    assert Activations(sp=True).bytes_per_device(8) == pytest.approx(36 * per_layer / 8)
    assert Activations(recompute="full").bytes_per_device(1) == pytest.approx(36 * 2 * 2048 * 4096)
    assert act.bytes_per_device(4) == pytest.approx(36 * activation_bytes_per_layer(2048, 1, 4096, 32, t=4))
    rows = tp_table(7.5e9, 64, 8)                       # 1/8 of the weights, ZeRO over the 8 DP ranks
    assert rows[0].bytes_per_device == pytest.approx(16 * 7.5e9 / 8)
    assert rows[3].bytes_per_device == pytest.approx(16 * 7.5e9 / 64)
    with pytest.raises(ValueError, match="must divide"):
        tp_table(7.5e9, 64, 3)
    md = markdown_table(zero_table(), activation_bytes=act.bytes_per_device(1))
    assert "activations (GB)" in md.splitlines()[0] and "| 34.4 | **154.4** |" in md.splitlines()[2]


def test_moving_the_tp_slider_redraws_without_error():
    box = _calculator()
    box.controls["tp"].value = 8
    from distlab.viz.widgets import Activations
    rows, act, *_ = box.state()
    assert rows[0].world_size == 64 // 8 and rows[0].num_params == pytest.approx(7.5e9 / 8)
    assert act == pytest.approx(Activations().bytes_per_device(8))
    box.controls["devices"].value = 12                   # 8 does not divide 12: a message, not a crash
    assert "must divide" in box.text()[0]
