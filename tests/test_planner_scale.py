"""Issue 40: the planner's new terms, each seen in `plan` and `candidates` — Llama shapes, interleaving,
ZeRO-3's latency at scale, selective recomputation, attention FLOPs, kernel efficiency, a cluster's NICs —
and the assumptions printed with every table."""
from __future__ import annotations

import pytest

from distlab.course.planner import (LLAMA_3_405B, Cluster, Layout, ModelSpec, Workload, assumptions, block_params,
                                    candidates, local_params, markdown, plan)
from distlab.theory import planning as pt
from distlab.theory.hardware import A100, H100
from distlab.theory.pipeline import bubble_fraction


def test_llama_shapes_are_sized_right():
    assert LLAMA_3_405B.num_params == pytest.approx(405.85e9, rel=1e-3)            # 405B, not 410B
    gpt = ModelSpec(126, 16384, 128, 128_256, 0)                                   # GPT blocks at Llama's depth and width
    assert gpt.num_params == pytest.approx(410e9, rel=0.01)                        # what the planner said before
    llama = ModelSpec.from_size(405e9, family="llama")
    assert (llama.n_layers, llama.kv_heads, llama.ffn_dim, llama.gated) == (126, 8, 53_248, True)
    # stages and tp shards add up; K and V split over tp = 8 (8 key/value heads), norms replicated
    spec = LLAMA_3_405B
    assert sum(local_params(spec, 1, 16, r) for r in range(16)) == spec.num_params
    d, f = 16384, 53_248
    assert block_params(spec, 8) == (2 * d * d + 2 * d * 1024 + 3 * d * f) // 8 + 2 * d
    tied = ModelSpec(4, 64, 4, vocab_size=100, max_seq=0, tied=True)
    assert tied.num_params == 4 * tied.layer_params + 100 * 64 + 2 * 64


def test_interleaving_shrinks_the_bubble_and_multiplies_the_messages():
    spec = ModelSpec(32, 256, 4, vocab_size=1000, max_seq=0)
    work = Workload(1024, 16)
    one = plan(spec, Layout(pp=16, m=16), work, Cluster(16), sequence_parallel=False)
    four = plan(spec, Layout(pp=16, m=16, v=2), work, Cluster(16), sequence_parallel=False)
    assert one.bubble == pytest.approx(15 / 31)                                   # 0.48 with plain 1F1B
    assert four.bubble == pytest.approx(bubble_fraction(16, 16, 2)) and four.layout.schedule == "interleaved"
    assert four.traffic["pp"][5] == 2 * one.traffic["pp"][5]                      # every chunk boundary, v = 2
    assert four.times["bubble"] < one.times["bubble"]
    with pytest.raises(ValueError, match="chunks"):
        plan(spec, Layout(pp=16, m=16, v=4), work)


def test_zero3_at_scale_pays_latency_and_unhidden_gathers():
    spec, work = LLAMA_3_405B, Workload(8192, 2048)
    c = Cluster(16384, H100, nic_GBps=pt.nic_GBps_per_gpu(8, 400))
    wide = plan(spec, Layout(dp=2048, tp=8, zero=3, m=1, recompute="full"), work, c)
    deep = plan(spec, Layout(dp=128, tp=8, pp=16, zero=1, m=16, v=4, recompute="full"), work, c)
    # one unit's gather over 2048 nodes: ring latency ~ 2047 network hops, ~20 ms, plus 800 MB at 50 GB/s
    gather = pt.collective_s("all_gather", block_params(spec, 8) * 2, 2048, 50e9, 2048)
    assert gather > 0.03
    assert wide.times["dp"] > 0.5 * wide.times["compute"]                         # the gathers do not hide
    assert deep.step_s < wide.step_s                                              # before issue 40: 0.6x


def test_selective_recomputation_and_attention_flops():
    spec = ModelSpec(24, 2048, 16, vocab_size=50_304, max_seq=0)
    work, c = Workload(8192, 64), Cluster(8, A100)
    none, sel, full = (plan(spec, Layout(dp=8, m=8, recompute=r), work, c, flash_attention=False)
                       for r in ("none", "selective", "full"))
    assert full.activation_bytes[0] < sel.activation_bytes[0] < none.activation_bytes[0]
    extra = 64 * 8192 * pt.recompute_flops_per_token("selective", 0, 24, 2048, 8192) / (8 * 312e12 * c.efficiency)
    assert sel.times["compute"] - none.times["compute"] == pytest.approx(extra)
    assert Layout(recompute=True).recompute == "full" and str(sel.layout).endswith("selective recompute")
    # MFU counts attention: at 8k tokens this model's attention is a third of its FLOPs
    flops = spec.flops_per_token(8192)
    assert flops == 6 * (24 * spec.layer_matmul_params + 50_304 * 2048) + 12 * 24 * 2048 * 8192
    assert none.mfu == pytest.approx(64 * 8192 * flops / (8 * 312e12 * none.step_s))
    modes = {p.layout.recompute for p in candidates(spec, Workload(4096, 32), Cluster(8, A100), flash_attention=False)}
    assert modes == {"none", "selective", "full"}


def test_kernel_efficiency_nics_and_assumptions_are_stated():
    c = Cluster(64, A100)
    assert c.efficiency == pytest.approx(271.2 / 312) and Cluster(64, A100, kernel_efficiency=0.5).mfu == 0.5
    spec = ModelSpec.from_size(7e9)
    layout, work = Layout(dp=64, zero=1, m=1), Workload(4096, 64)
    slow = plan(spec, layout, work, Cluster(64, A100, nic_GBps=pt.nic_GBps_per_gpu(4, 100)))
    fast = plan(spec, layout, work, c)
    assert slow.times["dp"] > fast.times["dp"]                                    # 6.25 vs 25 GB/s per GPU
    text = markdown([fast])
    assert "Assumptions:" in text and "86.9% of peak" in text and "Bekman" in text and "25 GB/s between nodes" in text
    assert "6.25 GB/s between nodes (this cluster's NICs)" in " ".join(assumptions(slow.cluster))
