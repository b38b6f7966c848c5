"""Pipeline stages of the course GPT, stand-in kernel costs, and reading a pipeline's timeline.

    stage = build_stage("tiny", index=r, stages=p)          # on distlab.device()
    h = stage(x)                     # stage 0: token ids -> hidden; last stage: hidden -> logits
    shape = activation_shape(stage.config, micro_batch=2)   # what crosses between stages

The package holds no schedule: GPipe and 1F1B are the chapter's lab. It holds
what every schedule needs — the model cut into stages that share the full
model's parameters, name for name (so gradients compare with one process), a
fixed cost standing in for GPU kernels, and the bubble read off a timeline.

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

import statistics
import time
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

from distlab.course.collectives import chunk_bounds
from distlab.course.models import GPT, GPTConfig, build_model


def stage_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) of the blocks each stage runs: contiguous, sizes differing by at most one."""
    if stages < 1 or stages > n_layers:
        raise ValueError(f"cannot cut {n_layers} blocks into {stages} stages: "
                         f"use 1..{n_layers} stages, or a model with more layers (n_layers=...)")
    return chunk_bounds(n_layers, stages)


class Stage(nn.Module):
    """Stage `index` of `stages`: blocks [a, b) of a GPT; embeddings on the first, the final norm
    and the head on the last. Shares the parameters of `model` (no copy).

    `full_names[local_name]` is each parameter's name in the whole model.
    """

    def __init__(self, model: GPT, index: int, stages: int) -> None:
        super().__init__()
        if not 0 <= index < stages:
            raise ValueError(f"stage index must be in 0..{stages - 1}, got {index}")
        self.config: GPTConfig = model.config
        self.index, self.stages = index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        a, b = stage_layers(model.config.n_layers, stages)[index]
        self.first_block = a
        if self.is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[a:b])
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head
        self.full_names = {name: self._full(name) for name, _ in self.named_parameters()}

    def _full(self, name: str) -> str:
        if name.startswith("blocks."):
            i, rest = name.split(".", 2)[1:]
            return f"blocks.{self.first_block + int(i)}.{rest}"
        return name

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        from distlab.engine.precision import compute_dtype
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return x.to(compute_dtype(x.dtype, x.device))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T) -> hidden (B, T, D); others: hidden -> hidden, or logits (B, T, V) last."""
        return self.body(self.embed(x) if self.is_first else x)


def build_stage(preset: str | GPTConfig = "tiny", index: int = 0, stages: int = 1, *, seed: int = 0,
                device: torch.device | str | None = None, **overrides: object) -> Stage:
    """Stage `index` of the course GPT cut in `stages`, with the same weights as `build_model(preset, seed=seed)`."""
    return Stage(build_model(preset, seed=seed, device=device, **overrides), index, stages)


def activation_shape(config: GPTConfig, micro_batch: int) -> tuple[int, int, int]:
    """(micro_batch, seq_len, d_model): the tensor one stage sends the next, and its gradient back."""
    return (micro_batch, config.seq_len, config.d_model)


def activation_dtype(config: GPTConfig, device: torch.device | str | None = None,
                     storage: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of the hidden states between stages: the compute dtype of the model's weights."""
    from distlab.engine.precision import compute_dtype
    return compute_dtype(storage, device)


def stage_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (what `distlab.course.models.lm_loss` computes)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def activation_bytes(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes one micro-batch's forward leaves alive on `stage` until its backward: the activations
    autograd saves, the stage's output (on the last stage, the loss and what it saves).

    `x`: one micro-batch of token ids (used by the first stage), `y`: its targets (used by the
    last); other stages get a random hidden state of the right shape. Measured with
    `distlab.meters.track_memory` after one untimed forward and backward (workspaces, lazy state).
    """
    from distlab.meters import track_memory
    from distlab.engine.runtime import device
    config = stage.config

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        inp = x if stage.is_first else torch.randn(
            activation_shape(config, x.shape[0]), device=device(),
            dtype=activation_dtype(config)).requires_grad_()
        out = stage(inp)
        return inp, (stage_loss(out, y) if stage.is_last else out)

    inp, out = forward()
    out.sum().backward()
    del inp, out
    with track_memory() as mem:
        inp, out = forward()
        held = mem.current_bytes
    del inp, out
    stage.zero_grad(set_to_none=True)
    return int(held)


def backward_transient_bytes(stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes above one micro-batch's activations while its backward runs on `stage`: the received
    gradient buffer (the activation's shape; none on the last stage, whose backward starts from its
    loss), the matrix products' temporaries, the input gradient on its way out. A pipeline's peak is
    the micro-batches it holds plus this transient of the one backward in progress.
    Measured like `activation_bytes`: peak of forward + backward minus what the forward left alive.
    """
    from distlab.meters import track_memory
    from distlab.engine.runtime import device
    config = stage.config
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)                      # accumulated in place, as in a pipeline's step
    for _ in range(2):                                    # the first pass makes lazy state
        inp = x if stage.is_first else torch.randn(
            activation_shape(config, x.shape[0]), device=device(), dtype=activation_dtype(config)).requires_grad_()
        with track_memory() as mem:
            out = stage(inp)
            if stage.is_last:
                out = stage_loss(out, y)
            held = mem.current_bytes
            if stage.is_last:
                out.backward()
            else:
                out.backward(torch.randn(out.shape, device=out.device, dtype=out.dtype))
            peak = mem.peak_bytes
        del inp, out
    stage.zero_grad(set_to_none=True)
    return int(peak - held)


# ---- a fixed cost in place of kernels ---------------------------------------------------------------

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


# ---- reading a timeline -----------------------------------------------------------------------------

def _rows(spans: Iterable[Any]) -> list[Mapping[str, Any]]:
    return [s if isinstance(s, Mapping) else s.__dict__ for s in spans]


def idle_fractions(spans: Iterable[Any]) -> dict[int, float]:
    """Per rank: the share of the step window it spent outside compute spans.

    The window runs from the first compute span's start to the last one's end,
    over all ranks (one step). Waiting for a message counts as idle.
    """
    rows = [r for r in _rows(spans) if r["kind"] == "compute"]
    if not rows:
        raise ValueError("no compute spans")
    t0, t1 = min(r["start"] for r in rows), max(r["end"] for r in rows)
    busy: dict[int, float] = {}
    for r in rows:
        busy[r["rank"]] = busy.get(r["rank"], 0.0) + (r["end"] - r["start"])
    return {k: 1.0 - v / (t1 - t0) for k, v in sorted(busy.items())}


def bubble(spans: Iterable[Any]) -> float:
    """The measured bubble fraction: the ranks' mean idle share of the step window."""
    return statistics.fmean(idle_fractions(spans).values())


def step_window(spans: Iterable[Any]) -> float:
    """Seconds from the first compute span's start to the last one's end, over all ranks: one step."""
    rows = [r for r in _rows(spans) if r["kind"] == "compute"]
    if not rows:
        raise ValueError("no compute spans")
    return max(r["end"] for r in rows) - min(r["start"] for r in rows)


def busy_per_microbatch(spans: Iterable[Any], m: int) -> float:
    """Seconds of compute per micro-batch, averaged over ranks: each rank's forward + backward of one
    micro-batch as it really ran (sleeps included, and whatever stretched them)."""
    rows = [r for r in _rows(spans) if r["kind"] == "compute"]
    busy: dict[int, float] = {}
    for r in rows:
        busy[r["rank"]] = busy.get(r["rank"], 0.0) + (r["end"] - r["start"])
    if not busy:
        raise ValueError("no compute spans")
    return statistics.fmean(busy.values()) / m


def slot_overhead(steps: Iterable[tuple[int, float, float]], p: int) -> float:
    """Fit T(m) = (m + p - 1)(s_m + o) to measured (m, step seconds T, busy seconds per micro-batch s_m):
    the idle time o each of the m + p - 1 slots adds beyond its work (messages, waking up). Least squares."""
    rows = [(m + p - 1, t, s) for m, t, s in steps]
    if not rows:
        raise ValueError("no steps to fit")
    return sum(k * (t - k * s) for k, t, s in rows) / sum(k * k for k, _, _ in rows)


def bubble_with_overhead(p: int, m: int, overhead_s: float, slot_s: float) -> float:
    """Idle share when each of the m + p - 1 slots takes slot_s of work plus overhead_s of waiting,
    and a rank works m of them: 1 - m slot_s / ((m + p - 1)(slot_s + overhead_s))."""
    return 1.0 - m * slot_s / ((m + p - 1) * (slot_s + overhead_s))
