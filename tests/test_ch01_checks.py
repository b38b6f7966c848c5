"""Chapter 1's graded checks catch wrong, cheating and hanging answers, not only missing ones."""
from __future__ import annotations

import dataclasses
import time

import pytest

from labkit import answers, run, strings as _lines

CHEAT = '''
def ring_all_reduce(tensor, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op)
    return tensor
'''
HALF = '''
def ring_all_reduce(tensor, op=dist.ReduceOp.SUM):
    ring_all_gather(tensor)
    return tensor
'''
# An off-by-one step count on rank 0: its last step is missing, so rank 1 waits for a message
# rank 0 never sends.
DEADLOCK = '''
def ring_all_gather(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    for s in range(n - 1 if r else n - 2):
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, chunks[(r - s - 1) % n], (r - 1) % n),
                                        dist.P2POp(dist.isend, chunks[(r - s) % n], (r + 1) % n)])
        for w in works:
            w.wait()
    return tensor
'''


def test_calling_the_library_passes_values_and_fails_traffic(no_orphans):
    out = _lines(run("01_collectives", "all_reduce", answers("01_collectives", replace={"ring_all_reduce": CHEAT})))
    assert out[0].startswith("PASS all_reduce, 2 ranks, values")
    assert out[1] == "FAIL all_reduce, 2 ranks, traffic: rank 0 called all_reduce: use only send/recv (isend/irecv)"
    assert not any(line.startswith("PASS") and "traffic" in line for line in out), out


def test_skipping_the_reduce_scatter_fails_values_and_traffic(no_orphans):
    out = _lines(run("01_collectives", "all_reduce", answers("01_collectives", replace={"ring_all_reduce": HALF})))
    assert all(line.startswith("FAIL") for line in out), out
    # metered in the very calls whose values are judged: 7 elements in chunks of 3, 2, 2 (1 element passes: the
    # all-gather alone sends what a whole all-reduce of chunks of 1, 0, 0 elements may send)
    assert out[3] == ("FAIL all_reduce, 3 ranks, traffic: rank 0, 7 elements, float32, sum: sent 20 bytes of S=28; "
                      "expected 32 or 36 or 40 (2(N-1)/N x S, for chunks of [3, 2, 2] elements)")


def test_a_deadlock_is_reported_in_seconds_with_its_case_and_line(no_orphans, short_stall):
    start = time.monotonic()
    out = _lines(run("01_collectives", "all_gather", answers("01_collectives", replace={"ring_all_gather": DEADLOCK})))
    took = time.monotonic() - start
    assert took < 60, took   # one stall window, then the remaining cases are skipped
    assert out[0].startswith(f"FAIL all_gather, 2 ranks, values: hung: rank(s) [1] waited {short_stall} s")
    assert "(case: 1 element, float32)" in out[0]
    # the learner's function, its file (here the test's name for the cell) and line: the last step's wait
    assert "rank 1 waits in ring_all_gather (replaced ring_all_gather, line 10)" in out[0], out[0]
    # the rank that never sent: rank 0 skipped its last step and returned
    assert "rank(s) [0] had already returned, so what the waiting rank(s) expect from it was never sent" in out[0]
    assert "a receive has no matching send" in out[0]
    assert out[2:] == [f"FAIL all_gather, {n} ranks, {k}: not run: an earlier case (2 ranks) hung"
                       for n in (3, 4) for k in ("values", "traffic")]


# A ring whose step counter never moves (`step += 1` forgotten): the ranks exchange chunks forever, busy,
# so no stall window ever ends it.
BUSY = '''
def ring_all_gather(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    step = 0
    while step < n - 1:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, chunks[(r - step - 1) % n], (r - 1) % n),
                                        dist.P2POp(dist.isend, chunks[(r - step) % n], (r + 1) % n)])
        for w in works:
            w.wait()
    return tensor
'''


def test_a_busy_loop_is_stopped_as_a_livelock_naming_its_line(no_orphans, monkeypatch):
    import distlab
    import distlab.checks.task as task
    # The floor of the livelock bound, lowered for this test from the learner's 6 s (as short_stall lowers the
    # hang window): both ranks burn CPU until it, and the floor applies (this case's reference is far faster).
    monkeypatch.setattr(task, "LIVELOCK_FLOOR_S", 2.0)
    LIVELOCK_FLOOR_S = task.LIVELOCK_FLOOR_S
    distlab.launch(lambda: None, 2)     # the fork server is up, as after a lab's setup cell
    start = time.monotonic()
    out = _lines(run("01_collectives", "all_gather", answers("01_collectives", replace={"ring_all_gather": BUSY})))
    took = time.monotonic() - start
    # CPU time bounds the loop, so its wall time grows with the machine's load; far under the case's cap
    assert took < 90, took
    head = f"FAIL all_gather, 2 ranks, values: never finished: rank(s) [0, 1] were still working after "
    assert out[0].startswith(head + f"{LIVELOCK_FLOOR_S:g} s of CPU time"), out[0]
    assert "(case: 1 element, float32)" in out[0]
    # the stack sample lands somewhere in the loop's body (lines 8 to 12 of the cell)
    import re
    lines = re.findall(r"rank (\d) was at ring_all_gather \(replaced ring_all_gather, line (\d+)\)", out[0])
    assert [r for r, _ in lines] == ["0", "1"] and all(8 <= int(n) <= 12 for _, n in lines), out[0]
    assert out[2:] == [f"FAIL all_gather, {n} ranks, {k}: not run: an earlier case (2 ranks) never finished"
                       for n in (3, 4) for k in ("values", "traffic")]


def test_forged_outputs_are_judged_outside_the_ranks(no_orphans):
    # A "ring" that returns garbage metadata instead of doing the work: the verdicts fail,
    # the verdict code does not crash.
    from distlab.checks import run_task
    from distlab.checks.ch01 import TASKS

    def forged(case, fn):
        return {"results": {"not": "tensors"}, "comm": 42}

    t = TASKS["reduce_scatter"]     # its first case (2 ranks): every case judges the same way
    forger = dataclasses.replace(t, exercise_fn=forged, case_list=t.case_list[:1])
    out = _lines(run_task(forger, [lambda tensor, op=None: tensor]))
    assert all(line.startswith("FAIL") and "malformed result" in line for line in out), out


def test_a_missing_output_names_what_was_missing_and_which_answer_it_comes_from():
    # issue 34: a KeyError while judging used to read "malformed result from the ranks (KeyError)"
    from distlab.checks.ch01 import TASKS
    from distlab.checks.task import Case
    t = TASKS["all_gather"]
    case = t.cases()[0]
    lines = t.judge(case, [{"results": {}}, {"results": {}}], {(7, "torch.float32", "sum"): None})
    assert [str(line) for line in lines] == [
        "FAIL all_gather, 2 ranks, values: malformed result from the ranks: no (7, 'torch.float32', 'sum') in what "
        "they returned (recorded on each rank by distlab.checks.ch01.ring_exercise): it comes from your "
        "ring_all_gather; did your ring_all_gather set (7, 'torch.float32', 'sum') (an attribute, or a key of what "
        "it returns) on every rank?",
        "FAIL all_gather, 2 ranks, traffic: malformed result from the ranks: no 'comm' in what they returned "
        "(recorded on each rank by distlab.checks.ch01.ring_exercise): it comes from your ring_all_gather; did your "
        "ring_all_gather set 'comm' (an attribute, or a key of what it returns) on every rank?"]
    assert isinstance(case, Case)
