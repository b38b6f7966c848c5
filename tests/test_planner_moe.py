"""Issue 37: the planner learns expert parallelism (ep) as an axis. Each term against a hand-worked value or
chapter 10's closed forms (distlab.theory.moe): Mixtral's shape, total vs active parameters, the all-to-all's
cost inside a node and across nodes, experts sharded over ep and their states over dp/ep, ep's traffic and
time, and the ranking walking ep. Pure arithmetic, no ranks."""
from __future__ import annotations

import pytest

from distlab.course.planner import (MIXTRAL_8X7B, Cluster, Layout, ModelSpec, Workload, assumptions, candidates,
                                    expert_block_params, frameworks, local_params, markdown, plan)
from distlab.theory import moe as mt
from distlab.theory import planning as pt
from distlab.theory.hardware import H100

LAT = pt.NCCL_RING


def test_mixtral_counts_what_the_paper_says():
    m, d, kv, f = MIXTRAL_8X7B, 4096, 1024, 14_336
    assert m.layer_params == 2 * d * d + 2 * d * kv + 8 * d + 8 * 3 * d * f + 2 * d
    assert m.num_params == 32 * m.layer_params + 2 * 32_000 * d + d
    assert m.num_params == pytest.approx(46.7e9, rel=1e-3)                   # Jiang et al. 2024: 46.7B total
    assert m.active_params == pytest.approx(12.9e9, rel=2e-3)                # 12.9B active per token
    # FLOPs per token count the active weights: attention, router, 2 of 8 experts, head; + 12 L h s
    active = 2 * d * d + 2 * d * kv + 8 * d + 2 * 3 * d * f
    assert m.layer_matmul_params == active
    assert m.flops_per_token(4096) == 6 * (32 * active + 32_000 * d) + 12 * 32 * d * 4096


def test_from_size_knows_the_mixtral_family():
    spec = ModelSpec.from_size(46.7e9, vocab_size=32_000, family="mixtral")
    assert (spec.n_layers, spec.num_params) == (32, MIXTRAL_8X7B.num_params)
    assert spec.active_params == MIXTRAL_8X7B.active_params
    large = ModelSpec.from_size(141e9, vocab_size=32_000, family="mixtral")
    assert large.active_params == pytest.approx(39.2e9, rel=1e-2)


def test_a_course_gpt_with_experts_counts_as_chapter_10_does():
    spec = ModelSpec(3, 32, 2, vocab_size=128, max_seq=16, n_experts=4, top_k=2)
    total, active = mt.moe_gpt_params(128, 16, 32, 3, 4, 2)
    assert (spec.num_params, spec.active_params) == (total, active)
    assert pt.expert_params(32, 128) == mt.expert_params(32, 128)
    from types import SimpleNamespace as NS
    config = NS(n_layers=3, d_model=32, n_heads=2, vocab_size=128, seq_len=16)
    assert ModelSpec.from_config(config, moe=NS(n_experts=4, k=2, d_ff=None)).num_params == spec.num_params
    # chapter 10's Mixtral-like course GPT on 64 ranks, ep = 8, dense parts replicated (ZeRO-0): 16 bytes per
    # parameter held, as theory.moe.ep_model_state_bytes
    big = ModelSpec.from_config(NS(n_layers=32, d_model=4096, n_heads=32, vocab_size=32_000, seq_len=4096),
                                moe=NS(n_experts=8, k=2, d_ff=21_504))
    experts = big.n_layers * big.layer_expert_params
    p = plan(big, Layout(dp=64, ep=8, zero=0, m=64), Workload(4096, 64), Cluster(64), vocab_parallel=False)
    assert p.model_state_bytes[0] == pytest.approx(mt.ep_model_state_bytes(big.num_params - experts, experts, 8, 8))


def test_all_to_all_is_n_minus_1_sends():
    S, nvl, nic = 64e6, 450e9, 50e9
    # inside a node: 7 NVLink hops, 7/8 of the send buffer leaves the rank
    assert pt.collective_s("all_to_all", S, 8, nvl) == pytest.approx(LAT.base + 7 * LAT.intra + S * 7 / 8 / nvl)
    # 16 ranks in 2 nodes: 7 peers in the node, 8 in the other; half the buffer crosses the NIC
    assert pt.all_to_all_latency_s(16, 2) == pytest.approx(LAT.base + 7 * LAT.intra + 8 * LAT.inter)
    assert pt.collective_s("all_to_all", S, 16, nic, 2) == pytest.approx(
        LAT.base + 7 * LAT.intra + 8 * LAT.inter + S * 8 / 16 / nic)
    # 8 ranks one per node (ep outside tp = 8): every peer a network hop
    assert pt.collective_s("all_to_all", S, 8, nic, 8) == pytest.approx(LAT.base + 7 * LAT.inter + S * 7 / 8 / nic)
    assert pt.collective_s("all_to_all", S, 1, nic) == 0
    # the bytes are chapter 10's uniform all-to-all, T k h e (ep-1)/ep
    T, k, h = 4096, 2, 4096
    assert pt.all_to_all_wire_bytes(T * k * h * 2, 8) == mt.uniform_a2a_bytes(T, k, h, 8, 2)


def test_moe_activations_keep_k_rows_per_token():
    s, b, d, f, E, k = 4096, 1, 4096, 14_336, 8, 2
    kw = dict(n_heads=32, kv=1024, ffn=f, gated=True, dropout=False)
    dense = pt.activation_bytes_per_layer(s, b, d, **kw)
    moe = pt.activation_bytes_per_layer(s, b, d, n_experts=E, top_k=k, **kw)
    # the MLP's input stays; each of k experts adds its permuted row (h) and its 3 inner tensors (f): e = 2
    assert moe - dense == pytest.approx(s * b * (2 * (k - 1) * 3 * f + 2 * k * d + 4 * E))
    assert pt.activation_bytes_per_layer(s, b, d, n_experts=E, top_k=k, tp=4, **kw) == pytest.approx(moe / 4)


def test_ep_shards_experts_and_their_states_over_dp_over_ep():
    spec = ModelSpec(4, 32, 2, vocab_size=128, max_seq=16, n_experts=4, top_k=2)
    assert sum(local_params(spec, 1, 2, r) for r in range(2)) == spec.num_params
    experts = spec.n_layers * spec.layer_expert_params
    dense = spec.num_params - experts
    assert local_params(spec, 1, 1, 0, ep=4) == dense + experts // 4
    assert expert_block_params(spec, 1, 4) == spec.layer_expert_params // 4
    work = Workload(16, 16)
    p0 = plan(spec, Layout(dp=4, zero=0, ep=4, m=2, micro_batch=2), work)
    assert p0.model_state_bytes[0] == pytest.approx(mt.ep_model_state_bytes(dense, experts, ep=4, dp=4))
    # ZeRO-1: the dense parts' optimizer states over dp = 8, the experts' over their dp/ep = 2 replicas
    p1 = plan(spec, Layout(dp=8, zero=1, ep=4, m=1, micro_batch=2), work)
    n = dense + experts // 4
    assert p1.model_state_bytes[0] == pytest.approx(4 * n + 12 * (-(-dense // 8) + -(-(experts // 4) // 2)))
    with pytest.raises(ValueError, match="divide dp"):
        Layout(dp=6, ep=4)
    with pytest.raises(ValueError, match="dense"):
        plan(ModelSpec(4, 32, 2), Layout(dp=2, ep=2), work)
    with pytest.raises(ValueError, match="experts"):
        plan(spec, Layout(dp=3, ep=3, m=1), Workload(16, 3))


def test_ep_traffic_and_its_time_inside_a_node_and_across():
    spec = ModelSpec(4, 64, 8, vocab_size=128, max_seq=0, n_experts=8, top_k=2)
    work, c = Workload(256, 64), Cluster(64)
    L = Layout(dp=8, ep=4, m=4, micro_batch=2)
    p = plan(spec, L, work, c)
    T, k, h, e = 2 * 256, 2, 64, 2
    per_layer = 4 * mt.uniform_a2a_bytes(T, k, h, 4, e) + mt.counts_bytes(8, 4)
    assert p.traffic["ep"] == [4 * 4 * per_layer]
    assert p.links["ep"] == "nvlink" and set(p.links) == {"tp", "cp", "ep", "dp", "edp", "pp"}
    nvl = H100.nvlink_GBps * 1e9
    call = lambda S: LAT.base + 3 * LAT.intra + S * 3 / 4 / nvl                  # noqa: E731
    assert p.times["ep"] == pytest.approx(4 * 4 * (4 * call(T * k * h * e) + call(8 * 8)))
    # tp = 8 fills the node: ep = 2 spans two nodes, each all-to-all one network hop, over the NIC
    q = plan(spec, Layout(dp=8, tp=8, ep=2, m=4, micro_batch=2), work, c)
    assert q.links["ep"] == "ib" and q.links["edp"] == "ib"
    Tq, nic = T / 8, c.ib_bytes_per_s                                            # sequence parallel: b s / tp
    one = lambda S: LAT.base + LAT.inter + S / 2 / nic                          # noqa: E731
    assert q.times["ep"] == pytest.approx(4 * 4 * (4 * one(Tq * k * h * e) + one(8 * 8)))
    # a dense model's plan has no ep term at all
    assert "ep" not in plan(ModelSpec(4, 64, 8, vocab_size=128), Layout(dp=8, m=4, micro_batch=2), work, c).times


def test_candidates_walk_ep_and_mixtral_on_64_gpus_chooses_it():
    plans = candidates(MIXTRAL_8X7B, Workload(4096, 1024), Cluster(64), zero_stages=(1,), micro_batches=(1,),
                       virtual_stages=(1, 2), recompute=("none",))
    eps = {p.layout.ep for p in plans}
    assert eps == {1, 2, 4, 8}
    assert all((p.layout.tp * p.layout.dp if p.layout.folded else p.layout.dp) % p.layout.ep == 0 for p in plans)
    assert {p.layout.expert_tp for p in plans if p.layout.tp == 2} == {1, 2}
    best = plans[0]
    # The reading at issue 37 (lecture 10 quotes it): ep = 8 inside a node, tp = 1, a short pipeline; MFU uses
    # the active parameters, so the ep all-to-all (~5 % of the step) and the bubble are what it pays.
    assert best.fits and best.layout.ep == 8 and best.layout.tp == 1 and best.links["ep"] == "nvlink"
    assert 0 < best.times["ep"] < 0.1 * best.step_s
    tokens = 1024 * 4096
    peak = H100.bf16_TFLOPs * 1e12
    assert best.mfu == pytest.approx(tokens * MIXTRAL_8X7B.flops_per_token(4096) / (64 * peak * best.step_s))
    assert "ep=8" in markdown(plans[:3]) and "all-to-all" in " ".join(assumptions(Cluster(64)))
    assert frameworks(best.layout).startswith("Megatron-LM")
    dense = candidates(ModelSpec.from_size(7e9), Workload(4096, 64), Cluster(8), micro_batches=(1,))
    assert {p.layout.ep for p in dense} == {1}


def test_folded_experts_are_whole_and_their_ep_stays_in_the_node():
    # MoE Parallel Folding (Liu et al. 2025): etp = 1, the experts' mesh ep x edp over the tp x dp ranks, ep innermost
    spec = ModelSpec(4, 64, 8, vocab_size=128, max_seq=0, n_experts=8, top_k=2)
    work, c = Workload(256, 64), Cluster(64)
    coupled = plan(spec, Layout(dp=4, tp=2, ep=4, m=4, micro_batch=4), work, c)
    folded = plan(spec, Layout(dp=4, tp=2, ep=8, etp=1, m=4, micro_batch=4), work, c)
    assert folded.layout.edp == 1 and coupled.layout.edp == 1 and str(folded.layout).count("etp=1") == 1
    # one whole expert per device against halves of two: the same weights, one replicated down bias (d) fewer
    assert expert_block_params(spec, 1, 8) == spec.expert_params
    assert coupled.params_local[0] - folded.params_local[0] == spec.n_layers * spec.d_model
    # ep = 8 beside tp = 2: folded it stays on NVLink (stride 1), coupled it would need two nodes
    assert folded.links["ep"] == "nvlink" and folded.links["edp"] == "nvlink"
    assert plan(spec, Layout(dp=8, tp=2, ep=8, m=2, micro_batch=4), work, c).links["ep"] == "ib"
    # the MLP's two tp all-reduces per block go (attention's two, the embedding's and the head's stay):
    # m x L x 2 calls x b s h x 2 bytes x ring 2(tp-1)/tp = 1
    assert coupled.traffic["tp"][0] - folded.traffic["tp"][0] == pytest.approx(4 * 4 * 2 * (4 * 256 * 64) * 2)
    with pytest.raises(ValueError, match="tp"):
        Layout(dp=4, tp=4, etp=2)
    from dataclasses import replace
    assert replace(coupled.layout, tp=4).expert_tp == 4 and replace(folded.layout, tp=4).folded
    with pytest.raises(ValueError, match="tp x cp x dp"):
        Layout(dp=4, tp=2, ep=16, etp=1)


def test_imbalance_slows_the_busiest_ep_rank():
    spec = ModelSpec(4, 64, 8, vocab_size=128, max_seq=0, n_experts=8, top_k=2)
    work, c = Workload(256, 64), Cluster(64)
    L = Layout(dp=8, ep=4, m=4, micro_batch=2)
    even, skew = plan(spec, L, work, c), plan(spec, L, work, c, imbalance=1.5)
    peak = H100.bf16_TFLOPs * 1e12 * c.efficiency
    experts = 4 * 2 * 2 * 64 * 256                       # L k (up + down: 2 h f, f = 4h) active expert weights
    assert skew.times["compute"] - even.times["compute"] == pytest.approx(64 * 256 * 6 * experts * 0.5 / (8 * peak))
    nvl = H100.nvlink_GBps * 1e9
    payload = 2 * 256 * 2 * 64 * 2 * 3 / 4 / nvl            # one all-to-all's bytes over NVLink
    assert skew.times["ep"] - even.times["ep"] == pytest.approx(4 * 4 * 4 * payload * 0.5)
    assert skew.mfu < even.mfu
    # ep = 1: every device runs all experts on its own tokens, so the skew costs nothing
    one = Layout(dp=8, m=4, micro_batch=2)
    assert plan(spec, one, work, c, imbalance=1.5).step_s == plan(spec, one, work, c).step_s
    with pytest.raises(ValueError, match="imbalance"):
        plan(spec, L, work, c, imbalance=0.5)
