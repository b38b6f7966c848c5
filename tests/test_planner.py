"""The layout planner: exact parameter counts per stage, model states, traffic and links, ranking."""
from __future__ import annotations

import math

import pytest

from distlab import theory
from distlab.course.models import PRESETS, build_model, num_params
from distlab.course.planner import (RECIPES, Cluster, Layout, ModelSpec, Workload, candidates, local_params, markdown,
                             plan, recipe)
from distlab.theory.pipeline import bubble_fraction, memory_3d


def test_spec_counts_the_course_model_exactly():
    for name in ("tiny", "small", "medium"):
        assert ModelSpec.from_config(PRESETS[name]).num_params == num_params(build_model(name, device="cpu"))


def test_stages_and_tensor_parallel_shards_add_up():
    spec = ModelSpec.from_config(PRESETS["tiny"]).__class__(4, 32, 2, 128, 16)
    whole = spec.num_params
    assert sum(local_params(spec, 1, 4, r) for r in range(4)) == whole
    d = spec.d_model
    # tp=2, replicated embeddings: the split parts halve, LayerNorms, row biases and vocab stay whole.
    per_block = (12 * d * d + 7 * d) // 2 + 6 * d
    assert local_params(spec, 2, 2, 0, vocab_parallel=False) == 2 * per_block + 128 * d + 16 * d
    assert local_params(spec, 2, 2, 1, vocab_parallel=False) == 2 * per_block + 128 * d + 2 * d
    assert local_params(spec, 2, 2, 1) == 2 * per_block + 64 * d + 2 * d


def test_from_size_lands_near_the_size():
    for size in (7e9, 70e9, 405e9):
        spec = ModelSpec.from_size(size)
        assert abs(spec.num_params / size - 1) < 0.05, spec


def test_model_states_follow_the_3d_formulas_for_a_balanced_model():
    # No embeddings: every stage holds Ψ/(tp pp) (give or take the final LayerNorm, 2d): the closed forms.
    spec = ModelSpec(8, 64, 4, vocab_size=0, max_seq=0)
    psi = spec.num_params
    for zero in (0, 1, 2, 3):
        p = plan(spec, Layout(dp=2, tp=1, pp=2, zero=zero, m=4), Workload(16, 16), vocab_parallel=False)
        for state in p.model_state_bytes:
            assert state == pytest.approx(memory_3d(psi, 2, 1, 2, zero), rel=1e-3)
    p = plan(spec, Layout(dp=4, tp=1, pp=2, zero=3, m=4), Workload(16, 32))
    assert p.model_state_bytes[0] == pytest.approx(16 * psi / 8, rel=1e-3)


def test_traffic_per_group():
    spec = ModelSpec(4, 32, 2, vocab_size=128, max_seq=16)
    L = Layout(dp=2, tp=2, pp=2, zero=1, micro_batch=2, m=4)
    p = plan(spec, L, Workload(16, 16), act_bytes=4, vocab_parallel=False)     # the chapter's 3-D code: no sp
    act = 2 * 16 * 32 * 4
    assert p.traffic["pp"] == [4 * act, 4 * act]
    # with sequence parallelism each tp rank sends its 1/tp of the activation (Megatron's scatter/gather)
    sp = plan(spec, L, Workload(16, 16), act_bytes=4, vocab_parallel=False, sequence_parallel=True)
    assert sp.traffic["pp"] == [2 * act, 2 * act] and sp.traffic["tp"] == p.traffic["tp"]
    assert p.traffic["tp"] == [4 * 2 * 4 * act * 2 * (1 / 2)] * 2      # 4 all-reduces per block, 2 blocks, m = 4
    assert p.traffic["dp"][0] == pytest.approx(2 * p.params_local[0] * 2 / 2)
    assert p.traffic["cp"] == [0.0, 0.0]
    assert p.bubble == pytest.approx(bubble_fraction(2, 4))


def test_links_follow_the_node():
    spec = ModelSpec(32, 1024, 16, vocab_size=1000, max_seq=0)
    p = plan(spec, Layout(dp=4, tp=8, pp=2, m=8), Workload(1024, 32), Cluster(64))
    assert p.links == {"tp": "nvlink", "cp": "nvlink", "dp": "ib", "pp": "ib"}
    p = plan(spec, Layout(dp=2, tp=4, pp=2, m=8), Workload(1024, 16), Cluster(16), sequence_parallel=False)
    assert p.links["tp"] == "nvlink" and p.links["dp"] == "nvlink" and p.links["pp"] == "ib"
    assert p.link_bytes()["ib"] == max(p.traffic["pp"])


def test_candidates_spend_batch_and_rank_fitting_layouts_first():
    spec = ModelSpec.from_size(70e9)
    plans = candidates(spec, Workload(4096, 64), Cluster(64))
    assert plans and all(p.layout.gpus == 64 for p in plans)
    for p in plans:
        L = p.layout
        assert L.dp * L.m * L.micro_batch == 64
        assert L.pp == 1 or L.m >= L.pp
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)
    assert plans[0].fits and plans[0].memory_bytes <= 80e9
    assert "| 1 |" in markdown(plans[:3])


def test_small_models_prefer_data_parallelism_as_the_recipe_table_says():
    spec = ModelSpec.from_size(7e9)
    best = candidates(spec, Workload(4096, 1024), Cluster(8))[0].layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8)
    assert recipe(7e9) == RECIPES[0][2] and recipe(13e9) == RECIPES[1][2]
    assert recipe(400e9).startswith("3-D") and recipe(1e9, gpus=1).startswith("ZeRO-Offload")


def test_invalid_layouts_say_why():
    spec = ModelSpec(4, 32, 2)
    with pytest.raises(ValueError, match="heads"):
        plan(spec, Layout(tp=3), Workload(16, 4))
    with pytest.raises(ValueError, match="stages"):
        plan(spec, Layout(pp=8, m=8), Workload(16, 8))


def test_widget_first_drawing():
    from distlab.course.planner import planner
    box = planner(7e9, 8, global_batch=64)
    assert box.children
