"""A fixed cost in place of kernels: `FixedCost` wraps a pipeline stage so that each forward and backward lasts a
known time, and records its spans on a timeline.

    timed = FixedCost(build_stage("tiny", r, p), forward_s=0.01, backward_s=0.02, timeline=tl)

Why a fixed cost: the course's CPU ranks share two cores, so a stage's real
compute time depends on what the other ranks do at that moment and the
timeline drowns in contention. `FixedCost` makes each forward last `forward_s`
and each backward `backward_s` (activation gradient) plus `weight_s` (weight
gradient): the real arithmetic runs, then the rank sleeps until the deadline,
so the cost replaces the compute's duration (it is not added to it) and every
stage takes the same, known time, like a kernel on its own GPU. A sleeping rank
leaves the cores to the others: with a cost ten times the compute, p ranks
need about p/10 of a core, which is why more ranks than cores still time the
schedule, not the contention.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn

from distlab.course.pipeline.stages import Stage


class _InputGradDone(torch.autograd.Function):
    """Identity; its backward (the stage's input gradient, B's last piece) marks that B ran in this pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mark: Any) -> torch.Tensor:
        ctx.mark = mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.mark()
        return grad, None


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def settle(device: torch.device | str) -> None:
    """Wait until the work queued so far on this thread's current stream of `device` has run: a stage's
    own kernels, and what they were ordered after (an NCCL recv's `wait()` makes the current stream wait
    for that recv). An event on that stream, not `torch.cuda.synchronize()`: a device-wide synchronise
    also waits for NCCL's streams, so for a send whose receive the peer has not posted yet, and a
    schedule that needs small sends to finish early (four stages, zero-bubble, a learner's 1F1B) would
    wait forever. Nothing to wait for on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


class FixedCost(nn.Module):
    """A stage whose forward takes exactly `forward_s` and whose backward takes `backward_s` (activation
    gradient) plus `weight_s` (weight gradient): the stand-in REPLACES the compute's duration. Each
    call runs the real arithmetic, then sleeps until its deadline (start + cost), so a span lasts the
    cost whatever the compute took, as long as the compute fits inside it (`overran` counts the
    calls where it did not; `calibrated_cost` picks a cost that leaves room). A sleeping rank leaves
    the cores to the others. A zero-bubble schedule runs the two parts of the backward apart, as B and W.

    With a `timeline` (`distlab.meters.Timeline`), each call records its span: `F{k}` for the k-th
    forward since `reset()`, `B{k}` for its backward (`W{k}` for a weight-gradient pass run apart).
    A backward span starts when the gradient of the stage's output is there, after `settle()`: on a
    GPU the received gradient has then landed (an NCCL recv's `wait()` only orders the streams), so
    waiting for a message is idle time, not backward time. It ends when autograd's pass over the
    stage is complete (a callback at the end of the pass, after `settle()`), weight gradients included.
    `settle()` waits on the compute stream only, never on sends still in flight.
    Schedules need no instrumentation of their own. Parameters, `config`, `is_first`, `is_last` are the stage's.
    """

    def __init__(self, stage: Stage, forward_s: float, backward_s: float, weight_s: float = 0.0,
                 timeline: Any = None) -> None:
        super().__init__()
        self.stage = stage
        self.config, self.is_first, self.is_last = stage.config, stage.is_first, stage.is_last
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.timeline = timeline
        self.device = next(stage.parameters()).device       # where `settle()` waits
        self.calls = 0
        self.overran = 0
        self._pass: dict[str, Any] | None = None           # the backward pass in progress on this stage
        self._weights_due: list[int] = []                   # micro-batches whose B ran without their W
        # The last parameter's gradient is among the first a weight-gradient pass computes.
        last = list(stage.parameters())[-1]
        self._hooks = [last.register_hook(self._weight_grad)]

    def reset(self, timeline: Any = None) -> None:
        """Number micro-batches from 0 again (a new step); optionally record into a new timeline."""
        self.calls = 0
        self._weights_due.clear()
        if timeline is not None:
            self.timeline = timeline

    def remove(self) -> Stage:
        """Take the hook off the stage's parameter; returns the bare stage."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return self.stage

    # -- the backward pass: begun by the output's gradient (B) or a weight gradient (W alone) ------------
    def _begin(self, k: int | None) -> dict[str, Any]:
        if self._pass is None:
            settle(self.device)                             # what this pass consumes has landed
            self._pass = {"k": k, "start": time.perf_counter(), "b": False, "w": False}
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        elif self._pass["k"] is None:
            self._pass["k"] = k
        return self._pass

    def _input_grad(self) -> None:
        if self._pass is not None:
            self._pass["b"] = True

    def _weight_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._begin(None)["w"] = True                       # a W pass alone starts here
        return grad

    def _end(self) -> None:
        run, self._pass = self._pass, None
        if run is None:
            return
        k = run["k"]
        if run["b"] and not run["w"]:
            self._weights_due.append(k)                     # its W comes in a pass of its own
        if run["w"] and not run["b"] and k is None:
            k = self._weights_due.pop(0) if self._weights_due else -1
        cost = self.backward_s * run["b"] + self.weight_s * run["w"]
        if time.perf_counter() > run["start"] + cost:
            self.overran += 1
        _sleep_until(run["start"] + cost)
        settle(self.device)
        if self.timeline is not None and (run["b"] or run["w"]):
            name = "B" if run["b"] else "W"
            self.timeline.add(f"{name}{k}", "compute", run["start"], time.perf_counter())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, self.calls = self.calls, self.calls + 1
        settle(self.device)                                 # the received input has landed
        start = time.perf_counter()
        h = self.stage.embed(x) if self.stage.is_first else x
        if h.requires_grad:
            h = _InputGradDone.apply(h, self._input_grad)
        out = self.stage.body(h)
        if out.requires_grad:
            # The gradient reaching the output is the first thing this stage's backward sees. A hook,
            # not a view: schedules may detach the output in place (zero-bubble ones do).
            out.register_hook(lambda grad: (self._begin(k), grad)[1])
        settle(self.device)
        if time.perf_counter() > start + self.forward_s:
            self.overran += 1
        _sleep_until(start + self.forward_s)
        if self.timeline is not None:
            self.timeline.add(f"F{k}", "compute", start, time.perf_counter())
        return out


def calibrated_cost(measured_s: float, *, factor: float = 10.0, floor_s: float = 0.004) -> float:
    """A forward cost that dominates the real compute (`factor` times it), at least `floor_s`."""
    if measured_s < 0:
        raise ValueError(f"measured time must be >= 0, got {measured_s}")
    return max(floor_s, factor * measured_s)
