"""`overheads_of` reads PyTorch's hop and gap off one-micro-batch steps on 2 ranks (no launch: spans made here)."""
from __future__ import annotations

import pytest

from distlab.course.pipeline.measure import overheads_of


def _span(rank, name, start, end):
    return {"rank": rank, "name": name, "kind": "compute", "start": start, "end": end}


def test_hop_and_gap_are_read_off_the_four_spans():
    # F = 1, B = 2, a message 0.1, 0.05 between rank 1's F and its B; two steps, the second 0.2 later on the clock.
    steps = [([_span(0, "F0.0", t, t + 1), _span(0, "BW0.0", t + 4.25, t + 6.25)],
              [_span(1, "F0.1", t + 1.1, t + 2.1), _span(1, "BW0.1", t + 2.15, t + 4.15)]) for t in (0.0, 10.2)]
    per_rank = [{"ScheduleGPipe": {"steps": [s[r] for s in steps]}} for r in range(2)]
    got = overheads_of(per_rank, "ScheduleGPipe")
    assert got["gap"] == pytest.approx(0.05)
    assert got["hop"] == pytest.approx(0.1)


def test_late_and_action_costs_are_read_off_the_spans():
    from distlab.course.pipeline.measure import action_costs, late_of
    # Schedule1F1B, 2 ranks, m = 2: rank 1 runs F0, BW0, F1, BW1; F1 starts 0.3 after BW0 (0.2 in the second step).
    steps = [[_span(1, "F0.1", t, t + 1), _span(1, "BW0.1", t + 1, t + 3), _span(1, "F1.1", t + 3 + d, t + 4 + d),
              _span(1, "BW1.1", t + 4 + d, t + 6 + d)] for t, d in ((0.0, 0.3), (10.0, 0.2), (20.0, 0.25))]
    per_rank = [None, {"Schedule1F1B": {"steps": steps, "chunks": [1]}}]
    assert late_of(per_rank) == pytest.approx(0.25)
    costs = action_costs(per_rank[1:], "Schedule1F1B")
    assert costs("F", 0, 1) == pytest.approx(1) and costs("B", 1, 1) == pytest.approx(2)   # BW read as B
    assert costs("W", 0, 1) is None                                                       # not run: the defaults
    # a zero-bubble stage 0: its I step costs nothing, its W the whole backward; the mean over micro-batches
    zb = [[_span(0, "B0.0", 0, 0), _span(0, "W0.0", 0, 2), _span(0, "W1.0", 3, 6)]]
    costs = action_costs([{"ScheduleZBVZeroBubble": {"steps": zb, "chunks": [0, 3]}}], "ScheduleZBVZeroBubble")
    assert costs("B", 0, 0) == 0 and costs("W", 5, 0) == pytest.approx(2.5)


def test_posts_read_off_a_lowered_table():
    from types import SimpleNamespace as A

    from distlab.course.pipeline.measure import _posts

    def act(kind, i, stage):
        return A(computation_type=A(value=kind), microbatch_index=i, stage_index=stage)
    # rank 1 of 2 holding stages 1 and 2: its receive for F1 on stage 1 is posted after its first action
    lowered = [act("RECV_F", 0, 1), act("F", 0, 1), act("RECV_F", 1, 1), act("SEND_F", 0, 1), act("F", 0, 2),
               act("F", 1, 1), act("RECV_B", 0, 2), act("B", 0, 2)]
    order = [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 0, 1)]
    assert _posts(lowered, order, [1, 2]) == [0, None, 1, 3]
