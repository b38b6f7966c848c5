"""Chapter 8's schedule simulation (the charts are drawn from it) and the fixed cost that stands in
for kernels: it replaces the compute's duration, and a backward span starts only once the received
gradient has landed (issue 23, item 8)."""
from __future__ import annotations

import time

import pytest
import torch

import distlab.meters
from distlab.course.models import synthetic_batch
from distlab.course.pipeline import simulate as sim
from distlab.course.pipeline.stages import FixedCost, activation_shape, bubble, build_stage, stage_loss
from distlab.meters import Timeline
from distlab.theory import pipeline as pt


@pytest.mark.parametrize("p,m", [(3, 4), (4, 8), (2, 1), (4, 2)])
def test_gpipe_and_1f1b_both_end_at_m_plus_p_minus_1_slots(p, m):
    for order in (sim.gpipe_order, sim.one_f_one_b_order):
        spans = sim.simulate(order, p, m, t_f=1, t_b=2)
        assert sim.makespan(spans) == (m + p - 1) * 3
        assert bubble(spans) == pytest.approx(pt.bubble_fraction(p, m))
        assert {s["end"] - s["start"] for s in spans if s["name"].startswith("B")} == {2.0}   # two units


def test_simulated_spans_respect_dependencies():
    spans = sim.simulate(sim.one_f_one_b_order, 4, 8, t_f=1, t_b=2)
    at = {(s["name"], s["rank"]): s for s in spans}
    for i in range(8):
        for r in range(4):
            if r:
                assert at[f"F{i}", r]["start"] >= at[f"F{i}", r - 1]["end"]     # its input activation
            if r < 3:
                assert at[f"B{i}", r]["start"] >= at[f"B{i}", r + 1]["end"]     # its output's gradient
    for r in range(4):                                                            # one action at a time
        mine = sorted((s["start"], s["end"]) for s in spans if s["rank"] == r)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))


def test_interleaved_and_zero_bubble_match_their_closed_forms():
    inter = sim.simulate(lambda p, m, r: sim.interleaved_order(p, m, r, 2), 4, 8, t_f=1, t_b=2, v=2)
    assert bubble(inter) == pytest.approx(pt.bubble_fraction(4, 8, v=2))
    zb = sim.simulate(sim.zero_bubble_order, 4, 8, t_f=1, t_b=1, t_w=1)
    assert bubble(zb) == pytest.approx(pt.zero_bubble_fraction(4, 8))
    with pytest.raises(ValueError, match="deadlocks"):
        sim.simulate(lambda p, m, r: [("B", 0), ("F", 0)], 2, 1)


class _Clock:
    """A fake `time` for FixedCost: sleeping and computing advance it exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def test_fixed_cost_replaces_the_compute_it_stands_for(monkeypatch):
    import distlab.course.pipeline.stages as stages
    clock = _Clock()
    monkeypatch.setattr(stages, "time", clock)
    stage = build_stage("tiny", 1, 2, n_layers=2, device="cpu")
    body, compute = stage.body, {"s": 0.01}
    stage.body = lambda h: (clock.sleep(compute["s"]), body(h))[1]
    tl = Timeline(rank=0, device="cpu")
    timed = FixedCost(stage, 0.05, 0.02, timeline=tl)
    h = torch.randn(activation_shape(stage.config, 2))
    timed(h)                                                        # compute 10 ms inside a 50 ms cost
    compute["s"] = 0.08
    timed(h)                                                        # compute 80 ms: longer than the cost
    f0, f1 = tl.spans
    assert f0.end - f0.start == pytest.approx(0.05)                 # added, it would be 0.06
    assert f1.end - f1.start == pytest.approx(0.08)                 # the compute, not 0.13
    assert timed.overran == 1


def test_backward_span_starts_after_the_received_gradient_has_landed(monkeypatch):
    """On NCCL a recv's wait() returns before the data is on the GPU; sync() waits for it. A backward
    stamped before sync() counts the wait for the message as backward time (the bubble reads low)."""
    landed = []
    pending = {"recv": False}

    def sync(device=None):                                          # the recv lands when the device syncs
        if pending["recv"]:
            time.sleep(0.05)
            pending["recv"] = False
            landed.append(time.perf_counter())

    monkeypatch.setattr(distlab.meters, "sync", sync)
    stage = build_stage("tiny", 1, 2, n_layers=2, device="cpu")
    tl = Timeline(rank=0, device="cpu")
    timed = FixedCost(stage, 0.0, 0.01, 0.0, timeline=tl)
    _, y = synthetic_batch(0, 2, stage.config, device="cpu")
    h = torch.randn(activation_shape(stage.config, 2), requires_grad=True)
    out = timed(h)
    grad = torch.empty_like(out)                                    # the irecv's buffer, not yet landed
    pending["recv"] = True
    out.backward(grad)
    b = next(s for s in tl.spans if s.name == "B0")
    assert landed and b.start >= landed[0]
