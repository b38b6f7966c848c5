"""Chapter 2's graded checks catch wrong, cheating and hanging answers, not only missing ones.

To stay fast, most tests run a task's 2-rank case only (`labkit.only`).
"""
from __future__ import annotations

import time

from distlab.checks.ch02 import TASKS
from labkit import answers, only, task_lines as _lines

LAB = "02_ddp"


# The solution passing every line is solutions/02_ddp.ipynb under nbval (every case of every check cell against
# its committed PASS lines) and tests/test_grading_class.py (graded as a learner's submission, sandboxed).


# The stubs failing every line is tests/test_labs.py::test_unfilled_lab_fails_every_graded_line (every lab).


SUM_NOT_MEAN = '''
class NaiveDDP(NaiveDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)      # forgot to divide by N
'''


def test_a_sum_instead_of_a_mean_fails_the_parameters_but_not_the_traffic(no_orphans):
    out = _lines(only(TASKS["naive"]), answers(LAB, replace={"NaiveDDP": SUM_NOT_MEAN}))
    assert out[0].startswith("PASS NaiveDDP: initial broadcast")
    assert out[1].startswith("FAIL NaiveDDP, 2 ranks, frozen weights: max |rank 0's")
    assert out[2].startswith("FAIL NaiveDDP, 2 ranks, tied weights")
    assert out[3].startswith("PASS NaiveDDP, 2 ranks: collectives and bytes")


NO_BROADCAST = '''
class NaiveDDP(NaiveDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module = module                 # no broadcast: ranks keep their own weights
'''


def test_skipping_the_broadcast_fails_only_the_broadcast_line(no_orphans):
    out = _lines(only(TASKS["naive"]), answers(LAB, replace={"NaiveDDP": NO_BROADCAST}))
    assert out[0].startswith("FAIL NaiveDDP: initial broadcast from rank 0: max |rank 1's")
    assert all(line.startswith("PASS") for line in out[1:]), out


# No broadcast either, but rank 0's weights rebuilt from the package's seed (100 + rank in the notebook's check):
# right weights in the notebook; the weights judged must come from the metered construction's broadcasts.
REBUILT_RANK0 = '''
from distlab.course.data_parallel.reference import make_model as _mk
class NaiveDDP(NaiveDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module = module
        mine = _mk("plain", seed=100 + dist.get_rank())
        if all(torch.equal(a, b.to(a.device)) for a, b in zip(module.parameters(), mine.parameters())):
            with torch.no_grad():
                for a, b in zip(module.parameters(), _mk("plain", seed=100).parameters()):
                    a.copy_(b)
'''


def test_rank_0_s_weights_rebuilt_without_a_broadcast_fail_the_broadcast_line(no_orphans):
    out = _lines(only(TASKS["naive"]), answers(LAB, replace={"NaiveDDP": REBUILT_RANK0}))
    assert out[0] == ("FAIL NaiveDDP: initial broadcast from rank 0: rank 0: construction called nothing; rank 0's "
                      "weights reach every rank by broadcast"), out     # the values matched: rank 1's too
    assert all(line.startswith("PASS") for line in out[1:]), out


# A "rung 2" that is rung 1 again: right values and bytes, but nothing overlaps backward.
NAIVE_AS_OVERLAPPED = '''
class OverlappedDDP(NaiveDDP):
    pass
'''


def test_an_overlapped_wrapper_that_waits_for_backward_fails_the_traffic_line(no_orphans):
    out = _lines(only(TASKS["overlapped"]), answers(LAB, replace={"OverlappedDDP": NAIVE_AS_OVERLAPPED}))
    assert all(line.startswith("PASS") for line in out[:3]), out
    assert out[3] == ("FAIL OverlappedDDP, 2 ranks: collectives and bytes: rank 0: 28 of 28 all-reduces started in "
                      "finish_gradient_synchronization(); launch them from the hooks, during backward")


# Buckets in forward order: right values, wrong layout (the first bucket would fill last).
FORWARD_ORDER = '''
class BucketedDDP(BucketedDDP):
    def __init__(self, module, bucket_size_mb=1.0):
        torch.nn.Module.__init__(self)
        self.module, self.buckets, self.where, self.works = module, [], {}, []
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        group, size = [], 0
        for p in [p for p in module.parameters() if p.requires_grad]:
            group.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_size_mb * 2**20:
                self.buckets.append(Bucket(group, p.dtype))
                group, size = [], 0
        if group:
            self.buckets.append(Bucket(group, group[-1].dtype))
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self.where[p] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad)
'''


def test_buckets_in_forward_order_fail_the_layout(no_orphans):
    out = _lines(TASKS["bucket_layout"], answers(LAB, replace={"BucketedDDP": FORWARD_ORDER}))
    assert out[0] == ("FAIL BucketedDDP.__init__: buckets in backward order, closed at 0.02 MiB: frozen weights, "
                      "rank 0: parameters are not in the order backward produces them (reverse of module.parameters())")
    assert out[1].startswith("PASS") and out[2].startswith("PASS"), out


# One flat all-reduce of every gradient after backward: right values and bytes, one call for 5 buckets.
ONE_BIG_ALL_REDUCE = '''
@add_to_class(BucketedDDP)
def _on_grad(self, p):
    b, i = self.where[p]
    b.views[i].copy_(p.grad)


@add_to_class(BucketedDDP)
def finish_gradient_synchronization(self):
    flat = torch.cat([b.flat for b in self.buckets])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for b in self.buckets:
        b.flat.copy_(flat[offset:offset + b.flat.numel()])
        offset += b.flat.numel()
        for p, view in zip(b.params, b.views):
            p.grad = view
'''


def test_one_all_reduce_for_every_bucket_fails_the_traffic_line(no_orphans):
    ns = answers(LAB, replace={"_on_grad": ONE_BIG_ALL_REDUCE})
    out = _lines(only(TASKS["bucketed"]), ns)
    assert all(line.startswith("PASS") for line in out[:3]), out
    assert out[3] == "FAIL BucketedDDP, 2 ranks: collectives and bytes: rank 0: 1 all-reduces for 5 buckets: one per bucket"


# Rank 0's hooks never launch anything: rank 1 waits in its first all-reduce forever.
DEADLOCK = '''
class OverlappedDDP(OverlappedDDP):
    def _launch(self, p):
        if dist.get_rank() == 0:
            return
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))
'''


def test_a_hang_is_reported_in_seconds_with_its_case_and_a_hint(no_orphans, short_stall):
    start = time.monotonic()
    out = _lines(TASKS["overlapped"], answers(LAB, replace={"OverlappedDDP": DEADLOCK}))
    took = time.monotonic() - start
    assert took < 60, took
    assert out[0].startswith("FAIL OverlappedDDP: initial broadcast from rank 0: hung: rank(s) [")
    assert "(case: OverlappedDDP, 2 ranks, tied weights: wrapping the model)" in out[0]   # rank 0 went on ...
    assert "rank 1 waits in finish_gradient_synchronization (" in out[0]                 # ... rank 1 did not
    assert "every rank must all-reduce the same tensors" in out[0]
    assert all(line == out[0].replace("OverlappedDDP: initial broadcast from rank 0", name)
               for line, name in zip(out[1:4], ("OverlappedDDP, 2 ranks, frozen weights",
                                                "OverlappedDDP, 2 ranks, tied weights",
                                                "OverlappedDDP, 2 ranks: collectives and bytes"))), out
    assert out[4:] == [f"FAIL {n}: not run: an earlier case (2 ranks) hung" for n in TASKS["overlapped"].lines()[4:]]


# The buckets' flat buffers made again without device=: on a GPU they would be CPU tensors meeting CUDA gradients.
HOST_BUCKETS = '''
class BucketedDDP(BucketedDDP):
    def __init__(self, module, bucket_size_mb=1.0):
        super().__init__(module, bucket_size_mb)
        for b in self.buckets:
            b.flat = torch.zeros(b.flat.numel())
            b.views, offset = [], 0
            for p in b.params:
                b.views.append(b.flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
'''


def test_a_bucket_made_without_a_device_is_caught_by_the_audit(no_orphans):
    out = _lines(only(TASKS["bucketed"]), answers(LAB, replace={"BucketedDDP": HOST_BUCKETS}))
    assert all(line.startswith("FAIL") and "raised DeviceAuditError: device audit: view_as() mixes" in line
               and "created without a device" in line for line in out), out


def test_the_lab_holds_the_prelude_one_line_checks_and_its_expected_time():
    import nbformat

    from distlab.checks.ch02 import PRELUDE
    from distlab.checks.labs import is_check_cell
    from labkit import ROOT
    nb = nbformat.read(ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert PRELUDE in code[0].source
    checks = [c for c in code if is_check_cell(c)]
    assert [[line for line in c.source.splitlines() if not line.startswith("#")] for c in checks] == [
        [f'grade("{name}", {TASKS[name].answers[0]})'] for name in TASKS]
    assert "*Expected time:" in nb.cells[0].source
