"""Issue 40: the published runs the planner is read against (distlab.course.planner.published): their data add
up, the published MFU is converted from Megatron's recompute-counted FLOPs, and one run is read end to end."""
from __future__ import annotations

import pytest

from distlab.course.planner import published as pub


def test_published_layouts_add_up_and_cite_a_source():
    for run in pub.RUNS:
        L = run.layout
        assert L["dp"] * L["tp"] * L["pp"] * L.get("cp", 1) == run.gpus, run.name
        assert run.global_batch % (L["dp"] * L.get("micro_batch", 1)) == 0, run.name
        assert "et al." in run.source and (run.mfu or run.tflops)
    sizes = {run.name.split(",")[0]: pub.spec_of(run).num_params for run in pub.RUNS}
    assert sizes["BLOOM 176B"] == pytest.approx(176.2e9, rel=2e-3)        # tied embeddings, ALiBi
    assert sizes["Llama 3 405B"] == pytest.approx(405.9e9, rel=1e-3)      # GQA, SwiGLU


def test_megatron_flops_are_converted_to_the_models_own():
    run = pub.RUNS[0]                                                      # 175B, 141 TFLOP/s with full recompute
    s, h, l, v = 2048, 12288, 96, 51_200
    mfu = 141 / 312 * 72 * (1 + s / (6 * h) + v / (12 * l * h)) / (96 * (1 + s / (6 * h) + v / (16 * l * h)))
    assert pub.published_mfu(run) == pytest.approx(mfu) and 0.33 < mfu < 0.35
    assert pub.published_mfu(pub.RUNS[-1]) == 0.38                        # Llama 3 reports MFU itself


def test_bloom_read_against_the_planner():
    row = pub.compare(next(r for r in pub.RUNS if r.name.startswith("BLOOM")))
    layout = row["pub"].layout
    assert (layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.recompute) == (8, 4, 12, 2, "full")
    assert row["pub"].fits and row["ratio"] == pytest.approx(row["pub"].step_s / row["best"].step_s)
    assert row["plans"][row["rank"] - 1] is row["pub"]
    # The reading at issue 40 (the lecture quotes it): BLOOM's mesh is the planner's favourite; the planner would
    # recompute selectively (not available to BLOOM in 2022) and so estimates BLOOM's own step 1.3x its best.
    assert row["mesh_rank"] == 1 and 1.2 < row["ratio"] < 1.45
    assert "| BLOOM 176B | 176B | 384 |" in pub.table([row])


def test_published_moe_layouts_add_up_and_their_models_are_mixtral():
    assert pub.MOE_API
    for run in pub.MOE_RUNS:
        L = run.layout
        assert L["dp"] * L["tp"] * L["pp"] * L["cp"] == run.gpus and L["dp"] % L["ep"] == 0, run.name
        assert run.global_batch % (L["dp"] * L["micro_batch"]) == 0 and "et al." in run.source
    small, large = (pub.spec_of(run) for run in pub.MOE_RUNS)
    assert (small.num_params, small.active_params) == (pytest.approx(46.7e9, rel=1e-3), pytest.approx(12.9e9, rel=2e-3))
    # Mixtral 8x22B (141B, 39B active, vocabulary 32768) with the benchmark's 32000-token vocabulary
    assert large.num_params == pytest.approx(140.6e9, rel=1e-3)
    assert large.active_params == pytest.approx(39.1e9, rel=2e-3)
    assert pub.published_mfu(pub.MOE_RUNS[1]) == pytest.approx(455 / 989) and pub.published_mfu(pub.MOE_RUNS[0]) == 0
