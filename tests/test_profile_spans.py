"""`profile_spans` puts every rank's spans on one clock, so a multi-rank Gantt chart lines up."""
import time

import torch
import torch.distributed as dist

import distlab

LATE_S = 1.0


def _late_rank_profile():
    from torch.profiler import record_function

    from distlab.meters import profile_spans
    if distlab.rank() == 1:
        time.sleep(LATE_S)                # this rank's profiler starts a second after rank 0's
    t = torch.ones(1024, device=distlab.device())

    def step():
        with record_function("fwd step"):
            (t * 2).sum()
        dist.all_reduce(t)                # ends on both ranks at once: rank 0 waits for rank 1
    before = time.perf_counter()
    spans = profile_spans(step)
    after = time.perf_counter()
    comm_end = max(s.end for s in spans if s.kind == "comm")
    return comm_end, before <= comm_end <= after


def test_two_ranks_spans_share_one_clock(no_orphans):
    (end0, inside0), (end1, inside1) = distlab.launch(_late_rank_profile, 2)
    assert inside0 and inside1            # on perf_counter's clock, within the call
    # The all-reduce ended together; on each profiler's own clock rank 0's end read LATE_S later.
    assert abs(end0 - end1) < LATE_S / 2, (end0, end1)
