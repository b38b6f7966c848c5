"""ZeRO-Offload's device -> host copies on a side stream (issue 26, item 4): `copy` returns before the
copy has run, copies run in issue order beside the caller, `wait` lands them all, and the meters of
the calling thread still count them."""
from __future__ import annotations

import threading

import torch

from distlab.course.offload import CopyStream, host_like, track_transfers
from distlab.course.pipeline.measure import copies_inside


def test_copies_run_beside_the_caller_and_land_on_wait():
    model = torch.nn.Linear(64, 64)
    model(torch.randn(4, 64)).sum().backward()
    side = CopyStream("cpu")
    gate = threading.Event()
    side._worker.submit(gate.wait)                      # the side stream is busy with earlier work
    bufs = [host_like(p) .zero_() for p in model.parameters()]
    with track_transfers(model) as meter:
        for b, p in zip(bufs, model.parameters()):
            side.copy(b, p.grad)                        # returns at once: queued, not run
        assert all(b.abs().sum() == 0 for b in bufs)
        gate.set()
        side.wait()
    assert all(torch.equal(b, p.grad) for b, p in zip(bufs, model.parameters()))
    assert meter.stats()["down_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert len(side.busy) == 2 and side.busy[0][1] <= side.busy[1][0]     # in issue order


def test_copies_inside_reads_the_overlap_off_a_timeline():
    spans = [{"name": "backward", "start": 0.0, "end": 1.0}, {"name": "copy down", "start": 0.5, "end": 1.5},
             {"name": "copy down", "start": 0.2, "end": 0.3}]
    assert abs(copies_inside(spans, "copy down", "backward") - 0.6 / 1.1) < 1e-12
    assert copies_inside(spans[:1], "copy down", "backward") is None


def test_a_hook_that_drops_the_gradient_still_books_its_copy():
    model = torch.nn.Linear(32, 32)
    side = CopyStream("cpu")
    bufs = {p: host_like(p) for p in model.parameters()}

    def down(p):
        side.copy(bufs[p], p.grad)
        p.grad = None                                   # as ZeRO-Offload's hook does, at once

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(down)
    with track_transfers(model) as meter:
        model(torch.randn(4, 32)).sum().backward()
    side.wait()
    assert meter.stats()["down_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
