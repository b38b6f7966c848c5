"""Chapter 10's harness: the simulated EP layout's model states equal the formula, the load figures read a
balanced share as 1, and the padded and grouped expert kernels compute the same rows."""
from __future__ import annotations

import torch

from distlab.course.models import GPTConfig
from distlab.course.moe import measure as mm
from distlab.course.moe.layer import MoEConfig
from distlab.theory import moe as th


def test_simulated_model_states_per_rank_equal_the_formula():
    cfg, moe = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_layers=2, n_heads=2), MoEConfig(8, 2, d_ff=48)
    dense, experts = mm.dense_and_expert_params(cfg, moe)
    ep = 4
    s = mm.ep_model_states(cfg, moe, world_size=8, ep=ep)
    assert (s.dense_params, s.expert_params) == (dense, experts // ep)
    assert s.params == s.grads == 2 * (dense + experts // ep) and s.optimizer == 12 * (dense + experts // ep)
    assert s.total == th.ep_model_state_bytes(dense, experts, ep=ep, dp=8 // ep)


def test_busiest_rank_and_expert_against_a_balanced_share():
    assigned = torch.tensor([[4, 4, 4, 4], [8, 4, 2, 2]])
    loads = mm.Loads(assigned, torch.tensor([[4, 4, 4, 4], [5, 4, 2, 2]]), [0.0, 0.0])
    assert loads.busiest_rank(2).tolist() == [1.0, 9 / 8]            # rank 0 computes 9 of a balanced 8
    assert loads.busiest_expert().tolist() == [1.0, 5 / 4]
    assert abs(loads.dropped - 3 / 32) < 1e-12


def test_padded_and_grouped_kernels_agree_on_the_kept_rows():
    sizes, cap = [5, 0, 3, 7], 4
    x = torch.randn(sum(sizes), 8, generator=torch.Generator().manual_seed(0))
    w1, w2 = mm.expert_weights(4, 8, 16)
    grouped = mm.grouped_experts(x, sizes, w1, w2).split(sizes)
    padded = mm.padded_experts(x, sizes, cap, w1, w2)
    for e, s in enumerate(sizes):
        assert torch.allclose(padded[e, :min(s, cap)], grouped[e][:cap], atol=1e-5)
        assert torch.equal(padded[e, min(s, cap):], torch.zeros_like(padded[e, min(s, cap):])) or s >= cap
