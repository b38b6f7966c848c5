"""Issue 40: the closed forms the planner's new terms rest on (distlab.theory.planning), each against a value
worked by hand or a published table. Pure arithmetic, no ranks."""
from __future__ import annotations

import pytest

from distlab.theory import planning as pt
from distlab.theory.hardware import A100, H100
from distlab.theory.pipeline import bubble_fraction


def test_gqa_and_swiglu_shapes():
    d = 12288
    assert pt.layer_params(d, 96, 96, 4 * d) == 12 * d * d + 13 * d                       # GPT
    # Llama 3 405B's block: q, o 16384^2; k, v 16384 x 1024 (8 of 128 heads); SwiGLU 3 x 16384 x 53248; 2 RMSNorms.
    d, f = 16384, 53_248
    assert pt.kv_dim(d, 128, 8) == 1024
    assert pt.layer_params(d, 128, 8, f, gated=True, bias=False, norm="rmsnorm") == \
        2 * d * d + 2 * d * 1024 + 3 * d * f + 2 * d
    with pytest.raises(ValueError, match="key/value heads"):
        pt.kv_dim(d, 128, 3)


def test_attention_flops_beside_6_psi():
    assert pt.attention_flops_per_token(126, 16384, 8192) == 12 * 126 * 16384 * 8192
    six_psi = 6 * 405e9
    assert pt.attention_flops_per_token(126, 16384, 8192) < 0.1 * six_psi        # 8k: a few percent
    assert pt.attention_flops_per_token(126, 16384, 131_072) > six_psi           # 128k: more than the weights
    assert pt.model_flops_per_token(405e9, 126, 16384, 8192) == six_psi + 12 * 126 * 16384 * 8192


def test_recomputation_costs():
    p, L, h, s = 1e9, 24, 2048, 4096
    model = pt.model_flops_per_token(p, L, h, s)
    assert pt.recompute_flops_per_token("full", p, L, h, s) == pytest.approx(model / 3)   # one more forward
    assert pt.recompute_flops_per_token("selective", p, L, h, s) == 4 * L * h * s          # QK^T and AV only
    assert pt.recompute_flops_per_token("none", p, L, h, s) == 0


def test_activations_follow_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    act = lambda **kw: pt.activation_bytes_per_layer(s, b, h, n_heads=a, tp=t, **kw) / sbh   # noqa: E731
    assert act(flash=False) == pytest.approx((34 + 5 * a * s / h) / t)                     # tp + sp
    assert act(flash=False, sp=False) == pytest.approx(10 + 24 / t + 5 * a * s / (h * t))  # tp only
    assert act(flash=False, recompute="selective") == pytest.approx(34 / t)                # tp + sp + selective
    assert act(flash=True) == act(flash=False, recompute="selective")                      # FlashAttention keeps no scores
    assert act(recompute="full") == pytest.approx(2 / t)
    # Llama 3 405B's block (GQA kv = h/16, SwiGLU f = 3.25 h, no dropout): attention 2(3 + 2/16), MLP 2(1 + 3 x 3.25), norms 4.
    llama = pt.activation_bytes_per_layer(s, b, 16384, n_heads=128, kv=1024, ffn=53_248, gated=True, dropout=False)
    assert llama / (s * b * 16384) == pytest.approx(2 * (3 + 2 / 16) + 2 * (1 + 3 * 3.25) + 4)


def test_interleaving_divides_the_bubble():
    assert bubble_fraction(16, 16) == pytest.approx(15 / 31)                   # 0.48: what 1F1B leaves idle
    assert bubble_fraction(16, 16, v=4) == pytest.approx(3.75 / 19.75)        # 0.19 with 4 chunks per rank


def test_collective_latency_grows_with_the_ring():
    lat = pt.NCCL_RING
    ag = pt.ring_latency_s("all_gather", 2048, 256)
    assert ag == pytest.approx(lat.base + (2047 - 255) * lat.intra + 255 * lat.inter)   # alpha N
    assert pt.ring_latency_s("all_reduce", 2048, 256) == pytest.approx(2 * ag - lat.base)
    assert pt.ring_latency_s("all_gather", 4096, 512) > 1.9 * ag - lat.base
    assert pt.ring_latency_s("all_gather", 1) == 0
    # tree all-reduce: log2(nodes) levels between nodes (alpha log N), and NCCL takes the faster
    tree = pt.tree_latency_s(2048, 256)
    assert tree == pytest.approx(lat.base + 2 * (7 * lat.intra + 8 * pt.NCCL_TREE_INTER))
    assert pt.collective_s("all_reduce", 0, 2048, 1e9, 256) == pytest.approx(min(tree, 2 * ag - lat.base))
    # alpha + beta: a 1 GB all-gather over 8 ranks in a node at 450 GB/s
    assert pt.collective_s("all_gather", 1e9, 8, 450e9) == pytest.approx(lat.base + 7 * lat.intra + 7 / 8 / 450)
    assert pt.group_nodes(8, 1) == 1 and pt.group_nodes(16, 8) == 16 and pt.group_nodes(4, 4) == 2


def test_zero3_exposes_the_first_gather_and_what_compute_cannot_cover():
    # gathers shorter than a unit's compute: only the first gather of each pass and the last reduce-scatter show
    assert pt.zero3_exposed_s(10, gather_s=1, scatter_s=1, forward_s=2, backward_s=4) == 1 + 1 + 1
    # gathers longer: each unit adds gather - forward (forward) and gather + scatter - backward (backward)
    assert pt.zero3_exposed_s(10, gather_s=3, scatter_s=2, forward_s=2, backward_s=4) == \
        (3 + 9 * 1) + (3 + 9 * 1 + 2)


def test_nic_bandwidth_per_gpu_and_kernel_efficiency():
    assert pt.nic_GBps_per_gpu(4, 100) == 6.25          # Jean Zay (BLOOM): 4 x 100 Gb/s Omni-Path per 8 A100s
    assert pt.nic_GBps_per_gpu(8, 200) == A100.ib_GBps  # DGX A100: one HDR NIC per GPU
    assert pt.nic_GBps_per_gpu(8, 400) == H100.ib_GBps  # Llama 3's H100 nodes: 8 x 400 Gb/s RoCE
    assert A100.kernel_efficiency == pytest.approx(271.2 / 312)
    assert H100.kernel_efficiency == pytest.approx(794.5 / 989)
