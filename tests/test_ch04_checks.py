"""Chapter 4's graded tasks reject wrong, cheating and hanging ZeRO-2 answers.

Each test replaces one piece of the solution (`labkit.answers(..., replace=...)`) and runs the task it
belongs to, on one world size where one is enough, asserting on the verdict lines themselves.
That the unfilled lab's stubs fail every line is tests/test_labs.py's, for every lab.
"""
from __future__ import annotations

import time

import pytest

from distlab.course.zero.buckets import GradBucket
from distlab.checks.ch04 import TASKS
from labkit import answer_sources, answers, case_lines, run, strings as _lines

LAB = "04_zero2"


# ---- no ranks: the bookkeeping ------------------------------------------------------------------

def test_grad_bucket_pads_to_a_multiple_of_n():
    import torch
    params = [torch.zeros(5), torch.zeros(2, 3)]
    b = GradBucket(params, start=10, world_size=4)
    assert (b.offsets, b.used, b.numel, b.chunk, b.start, b.nbytes) == ([0, 5], 11, 12, 3, 10, 44)
    assert b.flat is None and b.grad_shard is None and b.ready == 0
    with pytest.raises(ValueError):
        GradBucket(params, 0, 0)


# ---- wrong and cheating answers -------------------------------------------------------------------

FORWARD_ORDER = '''
def make_buckets(params, bucket_size_mb, world_size):
    seen, out, group, size, start = set(), [], [], 0, 0
    for p in params:                       # forward order: the embeddings' gradients come last
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            group.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_size_mb * 2**20:
                out.append(GradBucket(group, start, world_size))
                start += out[-1].numel
                group, size = [], 0
    if group:
        out.append(GradBucket(group, start, world_size))
    return out
'''


def test_buckets_in_forward_order_fail_the_order_line(no_orphans):
    out = _lines(run(LAB, "buckets", answers(LAB, replace={"make_buckets": FORWARD_ORDER})))
    assert out[0].startswith("FAIL buckets: every trainable parameter once, in backward order: "
                             "plain model, float32, bucket_size_mb=0.004, N=1: the buckets hold [tok.weight")


def test_a_skipped_broadcast_is_reported_as_a_hang_in_seconds(no_orphans, short_stall):
    # Rank 1 skips the broadcast of the flat buffer: rank 0 waits for it forever.
    cls = answer_sources(LAB)[1]
    assert "        dist.broadcast(self.flat_param, src=0)" in cls, "the solution changed: update this test"
    hang = cls.replace("        dist.broadcast(self.flat_param, src=0)",
                       "        if self.rank != 1:\n            dist.broadcast(self.flat_param, src=0)")
    start = time.monotonic()
    out = _lines(run(LAB, "construct", answers(LAB, replace={"ZeRO2": hang})))
    assert time.monotonic() - start < 90
    assert out[0].startswith("FAIL construct, 2 ranks: every rank starts from rank 0's weights: hung: rank(s) [0]"), out
    assert "(case: ZeRO2(...) on the plain model, 2 ranks)" in out[0] and "rank 0 waits in __init__ (" in out[0]
    assert "inside dist.broadcast" in out[0]     # the torch call it waits in
    assert "every rank must build the same buckets" in out[0]
    assert out[2:] == [f"FAIL construct, 4 ranks: {k}: not run: an earlier case (2 ranks) hung"
                       for k in ("every rank starts from rank 0's weights",
                                 "one flat buffer, rank r owns chunk r of every bucket")]


NO_VIEWS = '''
@distlab.add_to_class(ZeRO2)
def __init__(self, params, optimizer_class, bucket_size_mb=1.0, **defaults):
    params = list(params)
    torch.optim.Optimizer.__init__(self, params, defaults)
    self.world, self.rank = dist.get_world_size(), dist.get_rank()
    self.buckets = make_buckets(params, bucket_size_mb, self.world)
    self.where, self.pending = {}, []
    first = self.buckets[0].params[0]
    total = self.buckets[-1].start + self.buckets[-1].numel
    self.flat_param = torch.zeros(total, dtype=first.dtype, device=first.device)
    self.grad_shard = torch.zeros(total // self.world, dtype=first.dtype, device=first.device)
    chunks, offset = [], 0
    for b in self.buckets:
        for p, off in zip(b.params, b.offsets):
            self.flat_param[b.start + off:b.start + off + p.numel()].copy_(p.detach().reshape(-1))
            dist.broadcast(p.data, src=0)           # the right values, but p is not a view of the buffer
            self.where[p] = (b, off)
        lo = b.start + self.rank * b.chunk
        chunks.append(torch.nn.Parameter(self.flat_param[lo:lo + b.chunk], requires_grad=False))
        b.grad_shard = self.grad_shard[offset:offset + b.chunk]
        chunks[-1].grad = b.grad_shard
        offset += b.chunk
    self.optim = optimizer_class(chunks, **defaults)
'''


def test_parameters_outside_the_flat_buffer_fail_the_layout_line(no_orphans):
    out = case_lines(TASKS["construct"], answers(LAB, replace={"init": NO_VIEWS}), 2)
    assert out[0].startswith("PASS construct, 2 ranks: every rank starts from rank 0's weights")
    assert out[1].startswith("FAIL construct, 2 ranks: one flat buffer, rank r owns chunk r of every bucket: "
                             "rank 0, plain model: the trainable parameters live in ")


SYNC_AT_THE_END = '''
@distlab.add_to_class(ZeRO2)
@torch.no_grad()
def _on_grad(self, p):
    b, off = self.where[p]
    if b.flat is None:
        b.flat = torch.zeros(b.numel, dtype=p.grad.dtype, device=p.grad.device)
    b.flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
    p.grad = None
    b.ready += 1
    if all(c.ready == len(c.params) for c in self.buckets):   # ZeRO-1 style: everything at the very end
        for c in self.buckets:
            dist.reduce_scatter(c.grad_shard, list(c.flat.chunk(self.world)))
'''
ALL_REDUCE = '''
@distlab.add_to_class(ZeRO2)
@torch.no_grad()
def _on_grad(self, p):
    b, off = self.where[p]
    if b.flat is None:
        b.flat = torch.zeros(b.numel, dtype=p.grad.dtype, device=p.grad.device)
    b.flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
    p.grad = None
    b.ready += 1
    if b.ready == len(b.params):
        dist.all_reduce(b.flat)                                  # the library does the work, N x the bytes
        b.grad_shard.copy_(b.flat.chunk(self.world)[self.rank])
        b.flat = None
'''


@pytest.mark.parametrize("source, why", [
    (SYNC_AT_THE_END, "bucket(s) were complete but 0 reduce-scatter(s) had started"),
    (ALL_REDUCE, "during backward and _retire() expected only reduce-scatters, saw {'all_reduce'"),
], ids=["sync-at-the-end", "all-reduce"])
def test_right_values_at_the_wrong_time_or_cost_fail_the_when_line(source, why, no_orphans):
    out = case_lines(TASKS["backward"], answers(LAB, replace={"_on_grad": source}), 2)
    assert out[0].startswith("PASS backward, 2 ranks: summed gradient chunks"), out
    assert out[1].startswith("FAIL backward, 2 ranks: one async reduce-scatter per bucket, gradients freed: rank 0: ")
    assert why in out[1], out[1]


NO_MEAN = '''
@distlab.add_to_class(ZeRO2)
@torch.no_grad()
def step(self, closure=None):
    self._retire()                      # forgot: self.grad_shard.div_(self.world)
    self.optim.step()
    for b in self.buckets:
        mine = self.flat_param[b.start + self.rank * b.chunk:b.start + (self.rank + 1) * b.chunk]
        all_gather_tensor(self.flat_param[b.start:b.start + b.numel], mine.clone())
        b.ready = 0
'''


def test_a_sum_instead_of_a_mean_fails_the_values_not_the_traffic(no_orphans):
    out = case_lines(TASKS["step"], answers(LAB, replace={"step": NO_MEAN}), 2)
    assert out[0].startswith("FAIL step, 2 ranks: matches one process") and "SGD, tied weights" in out[0], out
    assert out[2].startswith("PASS step, 2 ranks: reduce-scatters in backward"), out


KEEP_BUCKETS = '''
@distlab.add_to_class(ZeRO2)
def _retire(self):
    for b, work in self.pending:
        work.wait()                     # forgot: b.flat = None
    self.pending.clear()
'''


def test_bucket_buffers_kept_alive_fail_both_memory_lines(no_orphans):
    out = case_lines(TASKS["memory"], answers(LAB, replace={"_retire": KEEP_BUCKETS}), 2)
    assert out[0].startswith("FAIL memory, 2 ranks: 2Ψ + 14Ψ/N bytes at a step boundary: rank 0 holds "), out
    assert out[1].startswith("FAIL memory, 2 ranks: never a full-size gradient (memory meter): rank 0 held "), out
