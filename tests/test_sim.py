"""Scale by simulation (distlab.course.sim): the fake run books what the real run books, and chapter 8's
planner predicts what the recipes' layouts hold.

The real runs are two gloo launches (N = 2 and 4), each measuring every strategy on the tiny model;
everything else runs in this process on fake tensors. The ZeRO paper's table at 7.5B on 64 ranks, measured
from the learner's classes (the shipped solutions), is checked in tests/test_tour.py: `distlab tour`
simulates exactly that table (the same shape, the same classes), and the suite runs it once.
"""
from __future__ import annotations

import functools

import pytest
import torch

import distlab
from distlab.course import sim
from distlab.course.models import PRESETS
from distlab.theory import comm_bytes_per_rank
from labkit import answers

CONFIG = PRESETS["tiny"]
BATCH = 8                      # rows in the global batch: 4 or 2 per rank
NAMES = list(sim.STRATEGIES)


@functools.lru_cache(maxsize=None)
def classes() -> dict:
    """The shipped solutions' classes (what a learner who finished labs 3-5 has)."""
    return {"ShardedOptimizer": answers("03_zero1").ShardedOptimizer, "ZeRO2": answers("04_zero2").ZeRO2,
            "ZeRO3": answers("05_zero3").ZeRO3}


# ---- fake equals real, to the byte --------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_simulated_bytes_equal_the_gloo_run(n):
    real = distlab.launch(sim.measure_steps, n, args=(NAMES, CONFIG, classes()), kwargs=dict(batch_size=BATCH), backend="gloo")[0]
    for name in NAMES:
        fake = sim.simulate(name, config=CONFIG, world_size=n, classes=classes(), micro_batch=BATCH // n,
                            native_bf16=False)
        got, want = (fake.model_state, fake.peak_bytes, fake.comm), (real[name].model_state,
                                                                     real[name].peak_bytes, real[name].comm)
        assert got == want, f"{name} on {n} ranks: simulated {got} != gloo {want}"
        assert fake.model_state.total > 0 and fake.comm.total_bytes > 0


# ---- a bug the simulation shows ---------------------------------------------------------------------------

def test_a_zero3_that_never_frees_its_gathered_units_peaks_higher():
    leaky = answers("05_zero3", replace={"_free": "def _leak(self, unit):\n    pass\nZeRO3._free = _leak\n"})
    config = sim.scale_config(1e9, n_layers=2)
    good = sim.simulate("zero3", config=config, world_size=64, classes=classes())
    bad = sim.simulate("zero3", config=config, world_size=64, classes={"ZeRO3": leaky.ZeRO3})
    # every unit stays gathered: the bf16 weights of the whole model (2 Psi) on top of the good peak
    assert bad.peak_bytes - good.peak_bytes == pytest.approx(2 * good.num_params, rel=0.05)
    assert bad.model_state == good.model_state


def test_a_strategy_without_its_class_says_which_lab_it_needs():
    with pytest.raises(ValueError, match="ZeRO3 class from lab 05_zero3"):
        sim.simulate("zero3", num_params=1e8, world_size=8)
    assert not torch.distributed.is_initialized()


def test_scale_config_hits_the_size_with_the_calculator_shape():
    c = sim.scale_config(7.5e9)
    assert (c.d_model, c.n_layers, c.n_heads, c.seq_len) == (4096, 36, 32, 2048)
    for psi in (1e8, 1.3e9, 13e9, 70e9, 175e9):
        c = sim.scale_config(psi)
        total = c.n_layers * (12 * c.d_model ** 2 + 13 * c.d_model) + (2 * c.vocab_size + c.seq_len + 2) * c.d_model
        assert total == pytest.approx(psi, rel=0.01)
        assert comm_bytes_per_rank(total, 8, 3) > 0


def test_fsdp2_at_scale_shards_everything_and_keeps_its_root_gathered():
    c = sim.scale_config(7.5e9, n_layers=2)
    r = sim.simulate("fsdp2", config=c, world_size=64, steps=1)
    assert r.model_state.total == pytest.approx(r.predicted_model_state_bytes, rel=0.01)
    # FSDP2 keeps the root unit (embeddings, head) gathered from forward to backward: the blocks are gathered
    # twice, the root once, every gradient reduce-scattered once: 2 Psi + Psi_blocks sent, not 3 Psi
    blocks = c.n_layers * (12 * c.d_model ** 2 + 13 * c.d_model)
    assert r.comm_bytes_per_step / r.predicted_comm_bytes_per_step == pytest.approx(
        (2 * r.num_params + blocks) / (3 * r.num_params), rel=1e-3)
    assert r.comm.calls["all_gather"] == 2 * 2 + 1


def test_distlab_simulate_prints_the_table(capsys):
    from distlab.apps.cli import main
    assert main(["simulate", "--strategy", "zero3", "--params", "1e8", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| zero3"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == cells[5]                    # model states measured == formula (GB, 3 decimals)
    assert "rank 0 of 64" in out and "cannot tell" in out
    assert main(["simulate", "--strategy", "zero9"]) == 2


def test_the_calculator_marks_the_simulated_cells():
    from distlab.viz.widgets import markdown_table, memory_calculator, zero_table
    md = markdown_table(zero_table(), simulated={0: 119.99e9, 3: 1.875e9})
    lines = md.splitlines()
    assert lines[0].endswith("simulated (GB) |")
    assert lines[2].endswith("120.0 (simulated) |") and lines[3].endswith("formula only |")
    assert lines[5].endswith("1.9 (simulated) |")
    pytest.importorskip("ipywidgets")
    import matplotlib
    matplotlib.use("Agg")
    box = memory_calculator(simulated={(7.5e9, 64): {3: 1.875e9}})
    assert "1.9 (simulated)" in box.text()[0] and "fake tensors" in box.text()[0]
    box.controls["devices"].value = 32          # no simulation at N = 32: formulas only
    assert "simulated" not in box.text()[0]


# ---- chapter 8's planner, checked against simulation ----------------------------------------------------

def test_the_planner_predicts_the_simulated_model_states_of_the_recipes_within_5_percent():
    # 7B ZeRO-2 on 8, 13B ZeRO-3 on 16, 70B ZeRO-3 + TP 8 on 64, 175B dp 8 x tp 8 x pp 16 + ZeRO-3 on 1024.
    # Short sequences: model states do not depend on them (beyond the position embedding, counted by both);
    # the tp/pp layouts skip forward and backward (zero gradients of each shard's shape: the same states).
    # Each recipe is simulated from a slice of 1 and 2 blocks per pipeline stage, extended to its depth (every
    # block adds the same states): the next test shows a slice gives the whole depth's bytes.
    checks = sim.check_recipes(classes(), seq_len=256, backward=False, blocks=1)
    assert [(c.name, c.gpus) for c in checks] == [("7B", 8), ("13B", 16), ("70B", 64), ("175B", 1024)]
    for c in checks:
        assert c.ratio == pytest.approx(1, abs=0.05), f"{c.name} {c.layout}: simulated / predicted = {c.ratio:.3f}"
        assert c.num_params == pytest.approx(float(c.name[:-1]) * 1e9, rel=0.05)
    # what each recipe leaves on a device, from the closed form: 2 Psi + 14 Psi / 8 for 7B with ZeRO-2
    assert checks[0].simulated_bytes == pytest.approx((2 + 14 / 8) * checks[0].num_params, rel=0.01)
    with pytest.raises(ValueError, match="ZeRO-3 over dp"):
        from distlab.course.planner import Layout, ModelSpec
        sim.check_plan(ModelSpec.from_size(1e9), Layout(dp=2, tp=2, zero=1), seq_len=64)


def test_a_slice_of_blocks_gives_the_model_states_of_the_whole_depth():
    from distlab.course.planner import Layout, ModelSpec
    # the lab's ZeRO-2 (flat buckets) on 8; FSDP2 over dp 2 x TP 2, pipeline stage 0 of 2: 3 blocks from 1 and 2
    for layers, layout in ((3, Layout(dp=8, zero=2)), (6, Layout(dp=2, tp=2, pp=2, zero=3, m=2))):
        spec = ModelSpec(n_layers=layers, d_model=64, n_heads=4, vocab_size=512, max_seq=64)
        whole = sim.check_plan(spec, layout, seq_len=64, classes=classes(), backward=False)
        sliced = sim.check_plan(spec, layout, seq_len=64, classes=classes(), backward=False, blocks=1)
        assert sliced.simulated_bytes == whole.simulated_bytes, layout
        assert whole.ratio == pytest.approx(1, abs=0.05)
