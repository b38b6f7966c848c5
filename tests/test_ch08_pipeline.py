"""Chapter 8's package pieces without ranks: stages, the fixed cost and its spans, bubble reading,
the transfer meter and the host/device account."""
from __future__ import annotations

import pytest
import torch

from distlab.meters import Span, Timeline
from distlab.course.models import build_model, lm_loss, num_params, synthetic_batch
from distlab.course.offload import host_device_split, host_like, track_transfers
from distlab.course.pipeline.bubble import bubble, idle_fractions
from distlab.course.pipeline.fixed_cost import FixedCost
from distlab.course.pipeline.stages import activation_bytes, activation_shape, build_stage, stage_layers, stage_loss


def test_stages_cover_the_model_and_share_its_weights():
    assert stage_layers(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        stage_layers(2, 3)
    model = build_model("tiny", n_layers=4, device="cpu")
    names = set()
    for r in range(4):
        s = build_stage("tiny", r, 4, n_layers=4, device="cpu")
        full = dict(model.named_parameters())
        for local, q in s.named_parameters():
            assert torch.equal(q, full[s.full_names[local]])
        names |= set(s.full_names.values())
    assert names == {n for n, _ in model.named_parameters()}


def test_stages_chained_compute_the_model():
    model = build_model("tiny", n_layers=4, device="cpu")
    x, y = synthetic_batch(0, 4, model.config, device="cpu")
    h = x
    for r in range(2):
        h = build_stage("tiny", r, 2, n_layers=4, device="cpu")(h)
    assert torch.allclose(h, model(x), atol=1e-6)
    assert stage_loss(h, y).item() == pytest.approx(lm_loss(model, x, y).item(), rel=1e-6)
    assert activation_shape(model.config, 3) == (3, model.config.seq_len, model.config.d_model)


def test_fixed_cost_sleeps_and_records_forward_and_backward():
    stage = build_stage("tiny", 1, 2, n_layers=2, device="cpu")
    tl = Timeline(rank=0, device="cpu")
    timed = FixedCost(stage, 0.02, 0.01, 0.01, timeline=tl)
    x, y = synthetic_batch(0, 2, stage.config, device="cpu")
    h = torch.randn(activation_shape(stage.config, 2), requires_grad=True)
    stage_loss(timed(h), y).backward()
    stage_loss(timed(h), y).backward()
    names = [s.name for s in tl.spans]
    assert names == ["F0", "B0", "F1", "B1"]
    f0, b0 = tl.spans[0], tl.spans[1]
    assert f0.end - f0.start >= 0.02 and b0.end - b0.start >= 0.02     # activation + weight gradient
    assert h.grad is not None and timed.config is stage.config
    timed.reset()
    assert timed.calls == 0
    last = list(stage.parameters())[-1]
    assert last._backward_hooks                                        # marks the weight-gradient pass
    assert timed.remove() is stage and not last._backward_hooks


def test_idle_fractions_and_bubble_from_spans():
    spans = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "B0", "compute", 3.0, 4.0),
             Span(1, "F0", "compute", 1.0, 3.0), Span(1, "x", "comm", 0.0, 4.0)]
    assert idle_fractions(spans) == {0: 0.5, 1: 0.5}
    assert bubble(spans) == 0.5
    with pytest.raises(ValueError):
        bubble([Span(0, "c", "comm", 0, 1)])


def test_activation_bytes_grow_with_the_micro_batch():
    stage = build_stage("tiny", 0, 2, n_layers=2, device="cpu")
    x, y = synthetic_batch(0, 4, stage.config, device="cpu")
    one, two = activation_bytes(stage, x[:2], y[:2]), activation_bytes(stage, x, y)
    assert one > 0 and two == pytest.approx(2 * one, rel=0.05)
    assert all(q.grad is None for q in stage.parameters())


def test_transfer_meter_counts_copies_between_model_and_host():
    model = build_model("tiny", device="cpu").to(torch.bfloat16)
    psi = num_params(model)
    x, y = synthetic_batch(0, 2, model.config, device="cpu")
    lm_loss(model, x, y).backward()
    host = [host_like(p) for p in model.parameters()]
    assert not any(h.is_pinned() for h in host)                        # no GPU: plain host memory
    with track_transfers(model) as meter:
        for h, p in zip(host, model.parameters()):
            h.copy_(p.grad)                                            # down: 2 bytes per parameter
            p.grad.float()                                             # a device-side temporary: no transfer
        with torch.no_grad():
            for h, p in zip(host, model.parameters()):
                p.copy_(h.float())                                     # up: the bf16 destination's bytes
    assert meter.stats() == {"down_bytes": 2 * psi, "up_bytes": 2 * psi,
                             "down_calls": len(host), "up_calls": len(host)}
    state = [torch.zeros(p.shape, dtype=torch.float32) for p in model.parameters()]
    split = host_device_split(model, state)
    assert split == {"device": 4 * psi, "host": 4 * psi}              # params + grads; fp32 state
    assert host_device_split((model, state)) == {"device": 8 * psi, "host": 0}


def test_step_window_busy_time_and_the_overhead_fit():
    from distlab.course.pipeline.bubble import bubble_with_overhead, busy_per_microbatch, slot_overhead, step_window
    from distlab.theory.pipeline import bubble_fraction
    spans = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "B0", "compute", 3.0, 4.0),
             Span(1, "F0", "compute", 1.0, 3.0)]
    assert step_window(spans) == 4.0
    assert busy_per_microbatch(spans, 1) == pytest.approx(2.0)
    # Steps that follow (m + p - 1)(s + o) exactly give back o; with o = 0 the bubble is the formula's.
    p, s, o = 4, 0.06, 0.01
    steps = [(m, (m + p - 1) * (s + o), s) for m in (1, 2, 4, 8)]
    assert slot_overhead(steps, p) == pytest.approx(o)
    assert bubble_with_overhead(p, 8, 0.0, s) == pytest.approx(bubble_fraction(p, 8))
    assert bubble_with_overhead(p, 8, o, s) == pytest.approx(1 - 8 * s / (11 * (s + o)))
