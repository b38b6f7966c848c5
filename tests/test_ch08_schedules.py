"""Chapter 8's schedule simulation (the charts are drawn from it) and the fixed cost that stands in
for kernels: it replaces the compute's duration, and a backward span starts only once the received
gradient has landed (issue 23, item 8)."""
from __future__ import annotations

import time

import pytest
import torch

from distlab.course.models import synthetic_batch
from distlab.course.pipeline import simulate as sim
from distlab.course.pipeline.bubble import bubble
from distlab.course.pipeline.fixed_cost import FixedCost
from distlab.course.pipeline.stages import activation_shape, build_stage, stage_loss
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


def test_a_late_receiver_pays_the_round_trip():
    # p = 2, m = 2, 1F1B, F = 1, B = 2, a message 0.1 to a waiting receiver. Rank 0 sends F1 at 2.1 while rank 1
    # is in B0 until 4.1: rank 1's F1 and rank 0's B0 (which waits for its send of F1) start `late` after 4.1.
    # Rank 0's B1 then waits for rank 1's B1 (ends 7.1 + late) and one hop: 9.3 with late = hop, 9.7 with 0.5.
    kw = dict(t_f=1, t_b=2, t_p2p=0.1, rendezvous=True)
    assert sim.makespan(sim.simulate(sim.one_f_one_b_order, 2, 2, **kw)) == pytest.approx(9.3)
    assert sim.makespan(sim.simulate(sim.one_f_one_b_order, 2, 2, t_late=0.1, **kw)) == pytest.approx(9.3)
    spans = sim.simulate(sim.one_f_one_b_order, 2, 2, t_late=0.5, **kw)
    at = {(s["name"], s["rank"]): s["start"] for s in spans}
    assert at["F1", 1] == at["B0", 0] == pytest.approx(4.1 + 0.5)
    assert sim.makespan(spans) == pytest.approx(9.7)


def test_runner_message_costs_read_the_sweeps_own_waits():
    from distlab.course.pipeline.calibration import runner_message_costs

    def span(name, start, end):
        return {"name": name, "kind": "compute", "start": start, "end": end}
    # GPipe on 2 ranks, m = 2, the runner's rendezvous. Rank 0: F1 after its send of F0 to a waiting rank 1 (hop
    # 0.2); B0 after rank 1's gradient, sent after rank 0 got free (hop 0.25; rank 1 had posted F1's receive at
    # 2.3, earlier); B1's gradient sent before rank 0 got there (late 0.35). Rank 1: F1's input sent before it got
    # there (late 0.3); B0 waits for nothing (gap 0.1); B1 after its send to a rank 0 that had posted (hop 0.15).
    r0 = [span("F0", 0, 1), span("F1", 1.2, 2.2), span("B0", 5.95, 7.95), span("B1", 8.3, 10.3)]
    r1 = [span("F0", 1.3, 2.3), span("F1", 2.6, 3.6), span("B0", 3.7, 5.7), span("B1", 5.85, 7.85)]
    per_rank = [{("gpipe", 2): [{"spans": r0}]}, {("gpipe", 2): [{"spans": r1}]}]
    got = runner_message_costs(per_rank, "gpipe", 2, sim.gpipe_order)
    assert got == pytest.approx({"hop": 0.2, "late": 0.325, "gap": 0.1})
    alone = runner_message_costs(per_rank[:1], "gpipe", 2, sim.gpipe_order)   # one rank: no message either way
    assert alone["hop"] is None and alone["late"] is None and alone["gap"] == pytest.approx((0.2 + 3.75 + 0.35) / 3)


def test_stage_of_places_two_chunks_in_a_v():
    # p = 2, v = 2, one micro-batch through 4 stages, each action 0.5, a message 0.1. Rank r holds chunks r and
    # r + p by default (every boundary crosses ranks: 6 messages), or r and 2p - 1 - r as ZBV does (stages 1 and 2
    # on rank 1: 4 messages).
    table = [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]
    kw = dict(t_f=1, t_b=1, v=2, t_p2p=0.1)
    assert sim.makespan(sim.simulate(lambda p, m, r: table, 2, 1, **kw)) == pytest.approx(4.6)
    v_shape = sim.simulate(lambda p, m, r: table, 2, 1, stage_of=lambda r, c: r if c == 0 else 3 - r, **kw)
    assert sim.makespan(v_shape) == pytest.approx(4.4)
    assert {s["name"] for s in v_shape if s["rank"] == 1} == {"F0.1", "F0.2", "B0.1", "B0.2"}
    with pytest.raises(ValueError, match="stage_of"):
        sim.simulate(lambda p, m, r: table, 2, 1, stage_of=lambda r, c: c, **kw)


class _Clock:
    """A fake `time` for FixedCost: sleeping and computing advance it exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def test_fixed_cost_replaces_the_compute_it_stands_for(monkeypatch):
    import distlab.course.pipeline.fixed_cost as fixed_cost
    clock = _Clock()
    monkeypatch.setattr(fixed_cost, "time", clock)
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
    """On NCCL a recv's wait() returns before the data is on the GPU; `settle` (an event on the stage's stream)
    waits for it. A backward stamped before that counts the wait for the message as backward time (the bubble
    reads low)."""
    import distlab.course.pipeline.fixed_cost as fixed_cost
    landed = []
    pending = {"recv": False}

    def settle(device=None):                                        # the recv lands when the stream settles
        if pending["recv"]:
            time.sleep(0.05)
            pending["recv"] = False
            landed.append(time.perf_counter())

    monkeypatch.setattr(fixed_cost, "settle", settle)
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
