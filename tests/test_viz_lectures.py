"""The figures the lectures draw through distlab.viz (issue 35: lecture cells of at most 20 lines): each
function is fed small records and its artists are read back, value by value."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from distlab import theory  # noqa: E402
from distlab.viz import plots  # noqa: E402


def _bars(ax):
    return [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle) and p.get_width() > 0]


def test_busbw_sweep_shades_the_latency_bound_side_and_draws_the_fitted_model():
    n, alpha, beta = 4, 1e-3, 5e8
    sizes = [2**10, 2**14, 2**18]
    records = [{"op": "all_reduce", "impl": "library", "bytes": s, "busbw_GBps": 0.1, "algbw_GBps": 0.05}
               for s in sizes]
    fit = {"world_size": n, "alpha_s": alpha, "beta_Bps": beta, "s_star_bytes": n * alpha * beta}
    fig = plots.busbw_sweep(records, fit=fit)
    ax = fig.axes[0]
    model = [line for line in ax.lines if line.get_label() == "alpha-beta fit (all_reduce)"]
    assert len(model) == 1
    want = [theory.busbw("all_reduce", s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta, n) / 1e9 for s in sizes]
    assert list(model[0].get_ydata()) == pytest.approx(want)
    span = [p for p in ax.patches if p.get_label() == "latency-bound (S < S*)"]
    assert len(span) == 1
    assert span[0].get_x() + span[0].get_width() == pytest.approx(fit["s_star_bytes"])   # up to S* = N alpha beta
    algbw = plots.busbw_sweep(records, metric="algbw_GBps", fit=fit).axes[0]   # shaded, but no busbw model
    assert not [line for line in algbw.lines if "fit" in line.get_label()]
    plt.close("all")


def test_memory_bars_stacks_the_optimizer_states_by_key_under_a_theory_line():
    psi = 1000
    measured = {"params": 2 * psi, "grads": 2 * psi, "master": 4 * psi, "exp_avg": 4 * psi, "exp_avg_sq": 4 * psi}
    fig = plots.memory_bars([measured], ["mixed"], [measured], unit=1, line=(16 * psi, "theory: 16 Psi"))
    ax = fig.axes[0]
    solid = [p for p in _bars(ax) if not p.get_hatch()]
    assert [p.get_height() for p in solid] == [2 * psi, 2 * psi, 4 * psi, 4 * psi, 4 * psi]
    assert max(p.get_y() + p.get_height() for p in solid) == 16 * psi
    (line,) = [ln for ln in ax.lines if ln.get_label() == "theory: 16 Psi"]
    assert set(line.get_ydata()) == {16 * psi}
    plt.close("all")


def test_loss_curves_draws_the_reference_and_every_run():
    fig = plots.loss_curves([3.0, 2.0, 1.0], {"N=2": [3.0, 2.0, 1.1], "N=4": [3.1, 2.0, 1.0]}, title="t")
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].lines}
    assert lines == {"1 process (reference)": [3.0, 2.0, 1.0], "N=2": [3.0, 2.0, 1.1], "N=4": [3.1, 2.0, 1.0]}
    plt.close("all")


def test_grouped_bars_puts_each_series_in_each_group():
    groups = {"N=2": {"step": 4.0, "no_sync": 3.0}, "N=4": {"step": 6.0, "no_sync": 5.0}}
    ax = plots.grouped_bars(groups, ylabel="ms", title="t").axes[0]
    heights = sorted((round(p.get_x() + p.get_width() / 2, 3), p.get_height()) for p in _bars(ax))
    assert [h for _, h in heights] == [4.0, 3.0, 6.0, 5.0]       # group by group, series in order
    assert [t.get_text() for t in ax.get_xticklabels()] == ["N=2", "N=4"]
    plt.close("all")


def test_measured_curve_and_peak_and_kept_draw_the_values_given():
    ax = plots.measured_curve([1, 2, 4], [10.0, 20.0, 30.0], xlabel="b", ylabel="s/s", title="t",
                              reference=(10.0, "one bucket")).axes[0]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines == {"measured": [10.0, 20.0, 30.0], "one bucket": [10.0, 10.0, 10.0]}
    ax = plots.peak_and_kept(["a", "b"], [8.0, 4.0], [6.0, 1.0], title="t", unit=1, line=(5.0, "2 Psi")).axes[0]
    assert [p.get_width() for p in _bars(ax)] == [8.0, 4.0, 6.0, 1.0]
    assert set(ax.lines[0].get_xdata()) == {5.0}
    plt.close("all")


def test_traffic_bars_stacks_each_run_by_collective_with_its_theory_tick():
    runs = [{"reduce_scatter": 3.0, "all_gather": 3.0}, {"all_reduce": 6.0, "broadcast": 4.0}]
    ax = plots.traffic_bars(["mine", "torch"], runs, [6.0, 6.0], title="t", unit=1).axes[0]
    ends = {}
    for p in _bars(ax):
        y = round(p.get_y() + p.get_height() / 2)
        ends[y] = max(ends.get(y, 0), p.get_x() + p.get_width())
    assert ends == {0: 6.0, 1: 10.0}
    assert [list(ln.get_xdata()) for ln in ax.lines] == [[6.0, 6.0], [6.0, 6.0]]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == \
        ["all-gather", "all-reduce", "broadcast", "reduce-scatter", "theory"]
    plt.close("all")


def test_stage_panels_draws_states_peaks_and_throughput_per_strategy():
    parts = {"params": 4.0, "grads": 4.0, "optimizer_state": 8.0}
    fig = plots.stage_panels(["DDP", "ZeRO-3"], [parts, {k: v / 2 for k, v in parts.items()}],
                             [parts, {k: v / 2 for k, v in parts.items()}], [30.0, 20.0], [100.0, 90.0],
                             title="t", unit=1)
    states, peaks, thr = fig.axes
    solid = [p for p in _bars(states) if not p.get_hatch()]
    assert max(p.get_y() + p.get_height() for p in solid) == 16.0
    assert sorted(p.get_y() + p.get_height() for p in solid)[:3] == [2.0, 4.0, 4.0]   # ZeRO-3's stack: 2, 4, 8
    assert [p.get_height() for p in _bars(peaks)] == [30.0, 20.0]
    assert [p.get_height() for p in _bars(thr)] == [100.0, 90.0]
    plt.close("all")


def test_activation_growth_plots_peak_minus_held_and_the_held_level():
    ax = plots.activation_growth([1, 2, 4], [3.0, 3.0, 3.0], [5.0, 7.0, 11.0], held_theory=3.0,
                                 held_theory_label="12 Psi/N", title="t", unit=1).axes[0]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines["peak during a step − bytes held before it (measured)"] == [2.0, 4.0, 8.0]
    assert lines["held before a step, after zero_grad(set_to_none=True) (measured)"] == [3.0, 3.0, 3.0]
    assert set(lines["12 Psi/N"]) == {3.0}
    plt.close("all")


def test_measured_and_theory_draws_a_line_and_dots_per_series():
    ax = plots.measured_and_theory({"none": ([32, 64], [2.0, 6.0], [2.0, 6.5]), "full": ([32, 64], [1.0, 2.0], [1.0, 2.0])},
                                   xlabel="S", ylabel="B", title="t").axes[0]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines == {"theory, none": [2.0, 6.5], "measured, none": [2.0, 6.0],
                     "theory, full": [1.0, 2.0], "measured, full": [1.0, 2.0]}
    plt.close("all")


def test_peak_over_rest_stacks_the_peak_on_the_resting_states():
    ax = plots.peak_over_rest(["N = 1", "N = 2"], [8.0, 4.0], [14.0, 11.0], [8.0, 4.0], title="t", unit=1).axes[0]
    bars = _bars(ax)
    assert [p.get_height() for p in bars] == [8.0, 4.0, 6.0, 7.0]       # rest, then peak - rest on top
    assert [p.get_y() for p in bars[2:]] == [8.0, 4.0]
    assert list(ax.lines[0].get_ydata()) == [8.0, 4.0]
    plt.close("all")


def test_paired_bars_leaves_out_a_missing_measurement_and_can_use_a_log_axis():
    ax = plots.paired_bars(["a", "b"], [2.0, None], [2.5, 3.0], xlabel="kB", title="t", log=True).axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert widths == [2.0, 0, 2.5, 3.0]                   # measured (b: none), then theory
    assert ax.get_xscale() == "log"
    plt.close("all")


def test_tables_give_the_records_values_as_compact_markdown():
    from distlab.meters.comm import CommStats
    from distlab.meters.memory import ModelState
    from distlab.viz import tables
    records = [{"op": op, "bytes": s, "busbw_GBps": v} for op, s, v in
               (("all_reduce", 1024, 0.0001837), ("all_gather", 1024, 0.0001123), ("all_reduce", 2**20, 0.5),
                                ("all_reduce", 2**26, 1.2968))]
    text = tables.busbw_table(records, ["all_reduce", "all_gather"]).data.splitlines()
    assert text[0] == "| S \\ busbw, MB/s | all_reduce | all_gather |"
    assert text[2:] == ["| 1 KiB | 0.184 | 0.112 |", "| 1 MiB | 500 | – |",      # MB/s, 3 digits; a dash where none
                        "| 64 MiB | 1,297 | – |"]
    comm = CommStats(calls={"all_reduce": 2, "broadcast": 53}, bytes={"all_reduce": 2_000_000, "broadcast": 416_000})
    meas = {"ZeRO-1": {"state": ModelState(params=4_000_000, grads=0, optimizer_state=2_628_000), "peak": 22_830_000,
                       "comm": comm}}
    row = tables.stage_table(meas, {"ZeRO-1": 6_624_000}).data.splitlines()[2]
    assert row == "| ZeRO-1 | 6.628 | 6.624 | +4,000 | 22.83 | 2.416 | all_reduce ×2, broadcast ×53 |"


def test_every_lecture_code_cell_fits_on_screen():
    """Issue 35: a lecture code cell holds at most 20 lines (plots go through distlab.viz, long functions split
    with add_to_class), so that the code the chapter teaches reads on one screen."""
    import json
    from pathlib import Path
    lectures = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(lectures) >= 11
    long = [(nb.name, i, n) for nb in lectures for i, c in enumerate(json.loads(nb.read_text())["cells"])
            if c["cell_type"] == "code" and (n := len("".join(c["source"]).rstrip("\n").splitlines())) > 20]
    assert not long, f"(notebook, cell, lines) over 20 lines: {long}"


def test_record_table_puts_each_prediction_beside_its_measurement():
    from distlab.viz import tables
    rec = {"name": "fsdp2", "model_state_bytes": {"params": 1104000, "grads": 1104000, "optimizer_state": 2208212},
           "predicted_model_state_bytes": {"params": 1104000.0, "grads": 1104000.0, "optimizer_state": 2208000.0},
           "peak_bytes": 19930896, "samples_per_s": 31.8176}
    lines = tables.record_table(rec, ["model_state_bytes", "peak_bytes", "samples_per_s"]).data.splitlines()
    assert lines[0] == "| record `fsdp2` | measured | predicted |"
    assert lines[2:] == ["| model state bytes | 1,104,000 / 1,104,000 / 2,208,212 | 1,104,000 / 1,104,000 / 2,208,000 |",
                         "| peak bytes | 19,930,896 | – |", "| samples per s | 31.8 | – |"]


def test_offload_table_puts_measured_beside_plain_and_theory():
    from distlab.theory import pipeline as pt
    from distlab.viz import tables
    res = {"psi": 100, "moved": [(200, 200), (200, 200)], "offload": {"device": 200, "host": 1600},
           "plain": {"device": 1600, "host": 0}, "peaks": {"offload": 5000, "plain": 6000}}
    lines = tables.offload_table(res, pt.offload(100)).data.splitlines()
    assert lines[2:] == ["| offload (measured) | 2.00 | 16.00 | 1.00 (all 2 steps) | 1.00 (all 2 steps) | 5,000 |",
                         "| plain, on the device (measured) | 16.00 | 0.00 | – | – | 6,000 |",
                         "| ZeRO-Offload (theory) | 2 | 14 | 1 | 1 | – |"]
    res["moved"][1] = (100, 200)                                   # a step that moved half: every step shows
    assert "| 1.00 / 0.50 | 1.00 (all 2 steps) |" in tables.offload_table(res, pt.offload(100)).data


def test_every_lecture_records_the_machine_its_outputs_came_from():
    """Issue 35: each lecture's first code cell prints `machine_line()`, so its committed timings say where they
    were measured (lecture 09 is excluded while it is reworked elsewhere)."""
    import json
    from pathlib import Path
    lectures = [nb for nb in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
                if not nb.name.startswith("09_")]
    assert len(lectures) >= 10
    missing = []
    for nb in lectures:
        first = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        text = "".join("".join(o.get("text", "")) for o in first.get("outputs", []))
        if "machine_line()" not in "".join(first["source"]) or not any(
                line.startswith("machine: ") for line in text.splitlines()):
            missing.append(nb.name)
    assert not missing, f"no 'machine: ' line in the first code cell's committed output: {missing}"
