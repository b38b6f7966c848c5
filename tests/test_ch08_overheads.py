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
