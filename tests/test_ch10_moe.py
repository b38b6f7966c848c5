"""Chapter 10's one-process MoE layer and closed forms, against values worked out by hand."""
from __future__ import annotations

import math

import torch

from distlab.course.moe.layer import (MoE, MoEConfig, build_moe_model, capacity, load_balancing_loss, moe_loss,
                                      param_counts, route, router_z_loss)
from distlab.theory import moe as th

# 4 tokens, 4 experts. Softmax of (2, 1, 0, 0): the top two renormalised are e/(e+1) and 1/(e+1).
LOGITS = torch.tensor([[2., 1., 0., 0.], [2., 0., 1., 0.], [0., 2., 1., 0.], [2., 1., 0., 0.]])


def test_top2_with_capacity_keeps_first_choices_first_in_token_order():
    expert, weight, slot = route(LOGITS, 2, capacity=2)
    assert expert.tolist() == [[0, 1], [0, 2], [1, 2], [0, 1]]
    g = math.e / (math.e + 1)
    assert torch.allclose(weight, torch.tensor([[g, 1 - g]] * 4))
    # first choices in token order: expert 0 <- tokens 0, 1 (full), token 3 dropped; expert 1 <- token 2.
    # second choices: expert 1 <- token 0 (slot 1), then token 3 (full: dropped); expert 2 <- tokens 1, 2.
    assert slot.tolist() == [[0, 1], [1, 0], [0, 1], [-1, -1]]
    assert route(LOGITS, 2)[2].tolist() == [[0, 1], [1, 0], [0, 1], [2, 2]]     # dropless: nobody dropped
    assert capacity(4, 2, 4, 1.0) == 2 and capacity(10, 2, 4, 1.25) == 7 and capacity(4, 2, 4, None) is None


def test_router_losses_by_hand():
    expert, _, _ = route(LOGITS, 2)
    p = LOGITS.softmax(-1).mean(0)
    f = torch.tensor([3, 3, 2, 0]) / 8                           # 8 assignments: 3 to expert 0, 3 to 1, 2 to 2
    assert torch.allclose(load_balancing_loss(LOGITS, expert), 4 * (f * p).sum())
    uniform = torch.zeros(8, 4)
    e_u = torch.tensor([[0, 1], [2, 3]] * 4)
    assert torch.allclose(load_balancing_loss(uniform, e_u), torch.tensor(1.0))   # balanced: exactly 1
    lse = torch.tensor([math.log(math.e ** 2 + math.e + 2)] * 2 + [math.log(math.e ** 2 + math.e + 2)] * 2)
    assert torch.allclose(router_z_loss(LOGITS), (lse ** 2).mean())


def test_moe_layer_is_the_gated_sum_of_its_kept_experts():
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, k=2, capacity_factor=1.0)
    x = torch.randn(6, 8)
    y = moe(x)
    expert, weight, slot = route(moe.router(x), 2, capacity(6, 2, 4, 1.0))
    want = torch.zeros_like(x)
    for t in range(6):
        for c in range(2):
            if slot[t, c] >= 0:
                want[t] += weight[t, c] * moe.experts[int(expert[t, c])](x[t:t + 1])[0]
    assert torch.allclose(y, want, atol=1e-6)
    assert moe.stats.assigned.sum() == 12 and moe.stats.kept.max() <= 3
    assert moe.stats.dropped == int((slot < 0).sum())
    # groups route on their own: two groups of 3 tokens = two calls on 3 tokens each
    moe.group_size = 3
    halves = torch.cat([MoE.forward(moe, x[:3]), MoE.forward(moe, x[3:])])
    moe.group_size = 3
    assert torch.allclose(moe(x), halves)


def test_total_and_active_parameters_of_the_course_gpt_with_moe_blocks():
    m = build_moe_model("tiny", MoEConfig(n_experts=4, k=2), device="cpu")
    c = m.config
    total, active = param_counts(m, 2)
    assert (total, active) == th.moe_gpt_params(c.vocab_size, c.seq_len, c.d_model, c.n_layers, 4, 2)
    assert total == 84544 and active == 51136         # 4 experts of 8 353 params in 2 layers; 2 used per token
    x = torch.randint(0, c.vocab_size, (2, c.seq_len))
    loss = moe_loss(m, x, x, aux_weight=0.01)
    ce = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
    aux = sum(b.moe.stats.aux_loss for b in m.blocks)
    assert torch.allclose(loss, ce + 0.01 * aux)


def test_traffic_closed_forms():
    # rank 0 keeps 3 rows for expert 0, 1 for expert 1, 2 for expert 2, 0 for 3; rank 1: 1, 2, 3, 4 (2 ranks)
    m = th.send_matrix([[3, 1, 2, 0], [1, 2, 3, 4]], ep=2)
    assert m == [[4, 2], [3, 7]]
    assert th.dispatch_bytes(m, 0, d_model=8, bytes_per_element=4) == 2 * 8 * 4
    assert th.combine_bytes(m, 0, d_model=8, bytes_per_element=4) == 3 * 8 * 4
    assert th.counts_bytes(8, 4) == 6 * 8
    assert th.uniform_a2a_bytes(16, 2, 8, 4, 4) == 16 * 2 * 8 * 4 * 3 / 4
    assert th.ep_model_state_bytes(10, 80, ep=8, dp=8) == 16 * (10 + 10)
    assert th.ep_model_state_bytes(64, 80, ep=8, dp=8, shard_dense=True, shard_experts_over_dp=True) == 16 * (1 + 1.25)
