"""Lab 8's graded tasks: a pipeline over send/recv (forward, GPipe, 1F1B), predictions graded against the
learner's 1F1B measured, interleaved and zero-bubble schedules as tables (checked by simulation), and
an offloaded optimizer.

Pipeline tasks run the learner's function on 2 and 4 stage ranks: rank r holds
stage r of the course GPT (`distlab.course.pipeline.stages.build_stage`), rank 0 gets the
token ids, the last rank the targets. Three verdict lines per case:

- values: the last rank's loss (or logits) and every stage's gradients equal
  one process's on the whole batch (computed here, without learner code);
- activations: the rank's peak bytes during the step, in units of one
  micro-batch's activations on that stage (measured on the rank just before):
  GPipe holds all m, 1F1B at most p - r;
- messages: only send/recv, one activation per micro-batch forward and one
  gradient per micro-batch backward on each link, exactly their bytes.

Offload tasks run on one rank with the course GPT in bf16 and check where the
optimizer's state lives, that gradients leave the device during the backward
(2Ψ bytes down) and parameters come back after the step (2Ψ up), and that the
parameters equal those of the plain `MixedPrecisionAdam` after three steps
(computed by a launch of its own, on the same kind of device).

Under `distlab grade` the values come from inputs drawn from a secret seed (`inputs`), never the package's
seeded ones: every stage's starting weights (each rank gets only its own stage's), the token ids (only the
first stage's ranks, their dp replica's rows) and the targets (only the last stage's); the offloaded
optimizer's starting weights and batches. The references are computed from the same drawn inputs.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

import distlab
from distlab.checks.draws import load_weights
from distlab.checks.task import Case, Line, Row, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import CheckFailed, compare, expect
from distlab.meters import track_comm, track_memory

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist

import distlab
from distlab.meters import sync
from distlab.course.offload import host_like
from distlab.course.pipeline.stages import activation_shape, stage_loss"""

from distlab.checks.ch08_common import (LAYERS, MICRO, PIPE_1F1B_HINT, PIPE_HINT, PRESET, SEED,  # noqa: F401
                                        _batch, _drawn_stages, _model_of_stages, _stage_batch)


# ---- pipelines run on real stages: `kind` is 'forward' (inference only), 'gpipe' or '1f1b' ----------------

def pipeline_cases(kind: str, shapes: tuple[tuple[int, int], ...]) -> list[Case]:
    out = []
    for p, m in shapes:
        head = f"{kind}, {p} stages, m={m}"
        lines = (f"{head}, values", f"{head}, messages") if kind == "forward" else (
            f"{head}, values", f"{head}, activations", f"{head}, messages")
        out.append(Case(p, lines, {"m": m}))
    return out


def pipeline_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: rank r's stage weights; the tokens to rank 0 only, the targets to the last rank only."""
    p = case.world_size
    out, x, y = _drawn_stages(rng, p, MICRO * case.args["m"], LAYERS)
    out[0]["x"], out[p - 1]["y"] = x, y
    return out


def pipeline_exercise(kind: str, case: Case, fn: Any, inputs: dict | None = None) -> dict:
    from distlab.course.pipeline.stages import activation_bytes, build_stage
    p, m, r = case.world_size, case.args["m"], distlab.rank()
    stage = build_stage(PRESET, r, p, seed=SEED, n_layers=LAYERS)
    if inputs is None:
        x, y = _batch(m, stage.config)
    else:
        load_weights(stage, inputs, "w.")
        x, y = _stage_batch(inputs, MICRO * m, stage.config)
    first, last = r == 0, r == p - 1
    unit = 0
    if kind != "forward":
        distlab.engine.runtime.progress(f"{p} stages, m={m}: measuring one micro-batch")
        unit = activation_bytes(stage, x[:MICRO], y[:MICRO])
        for q in stage.parameters():
            q.grad = torch.zeros_like(q)      # gradients accumulate in place: not activations
    distlab.engine.runtime.progress(f"{kind}, {p} stages, m={m}")
    with track_memory() as mem, track_comm() as comm:
        if kind == "forward":
            with torch.no_grad():
                out = fn(stage, x if first else None, m, MICRO)
        else:
            out = fn(stage, x if first else None, y if last else None, m, MICRO)
    if isinstance(out, torch.Tensor):
        out = out.detach().float().cpu()
    grads = {} if kind == "forward" else {
        stage.full_names[n]: (q.grad.detach().clone() if q.grad is not None else None)
        for n, q in stage.named_parameters()}
    return {"out": out if last else None, "grads": grads, "peak": int(mem.peak_bytes), "unit": unit,
            "comm": comm.stats()}


def pipeline_reference(kind: str, case: Case, inputs: list | None = None) -> dict:
    from distlab.course.models import build_model, lm_loss
    if inputs is None:
        model = build_model(PRESET, seed=SEED, n_layers=LAYERS, device="cpu")
        x, y = _batch(case.args["m"], model.config, device="cpu")
    else:
        model = _model_of_stages(inputs, LAYERS)
        x, y = inputs[0]["x"], inputs[-1]["y"]
    if kind == "forward":
        with torch.no_grad():
            return {"out": model(x).float(), "grads": {}}
    loss = lm_loss(model, x, y)
    loss.backward()
    return {"out": loss.detach(), "grads": {n: q.grad.clone() for n, q in model.named_parameters()},
            "act_bytes": MICRO * model.config.seq_len * model.config.d_model * 4}


def pipeline_judge(kind: str, case: Case, outputs: list, reference: dict) -> list[Line]:
    p, m = case.world_size, case.args["m"]
    names = case.lines

    def values() -> str:
        out = outputs[p - 1]["out"]
        expect(out is not None, f"the last rank (rank {p - 1}) returned None: it must return the "
               + ("logits of the whole batch" if kind == "forward" else "mean loss"))
        mine = torch.as_tensor(out, dtype=torch.float32)
        if kind != "forward":
            mine = mine.reshape(())
        compare(mine, reference["out"].float(), atol=1e-5, rtol=1e-4,
                what="the last rank's " + ("logits" if kind == "forward" else "loss"))
        if kind == "forward":
            return "the last rank's logits equal one process's"
        seen = {}
        for r, o in enumerate(outputs):
            seen.update({k: (r, v) for k, v in o["grads"].items()})
        expect(set(seen) == set(reference["grads"]), "the stages do not cover the model's parameters")
        for name, want in reference["grads"].items():
            r, g = seen[name]
            expect(g is not None and bool(g.abs().sum() > 0),
                   f"rank {r}: {name} has no gradient: run the backward of every micro-batch")
            try:
                compare(g, want, atol=1e-5, rtol=1e-4, what=f"rank {r}'s gradient of {name}")
            except CheckFailed as exc:
                raise CheckFailed(f"{exc}; scale each micro-batch's loss by 1/m") from None
        return "loss and every gradient equal one process's on the whole batch"

    def activations() -> str:
        for r, o in enumerate(outputs):
            held = o["peak"] / max(o["unit"], 1)
            want = m if kind == "gpipe" else min(m, p - r)
            if held > want + 1.0:
                raise CheckFailed(f"rank {r} held {held:.1f} micro-batches of activations at its peak; "
                                  f"{kind} holds at most {want}"
                                  + ("" if kind == "gpipe" else
                                     ": start each backward as soon as its gradient can arrive"))
            if kind == "gpipe" and held < m - 0.5:
                raise CheckFailed(f"rank {r} held {held:.1f} micro-batches at its peak; GPipe runs every "
                                  f"forward before any backward and holds all m = {m}")
        return ("holds all m micro-batches' activations" if kind == "gpipe"
                else "holds at most p - r micro-batches' activations on rank r")

    def messages() -> str:
        act = reference.get("act_bytes", MICRO * 16 * 32 * 4)
        for r, o in enumerate(outputs):
            stats = o["comm"]
            other = sorted(set(stats.calls) - {"send", "recv"})
            expect(not other, f"rank {r} called {', '.join(other)}: a pipeline uses only send/recv")
            links = (r < p - 1) + (0 if kind == "forward" else (r > 0))
            sends, sent = stats.calls.get("send", 0), stats.bytes.get("send", 0)
            recvs = stats.calls.get("recv", 0)
            want_recvs = (r > 0) + (0 if kind == "forward" else (r < p - 1))
            expect(sends == m * links and recvs == m * want_recvs,
                   f"rank {r} posted {sends} sends and {recvs} receives; expected {m * links} and "
                   f"{m * want_recvs} (one message per micro-batch and direction)")
            expect(sent == m * links * act,
                   f"rank {r} sent {sent} bytes; expected {m * links * act} (one activation of "
                   f"{act} bytes per message)")
        return "one activation per micro-batch and direction, send/recv only"

    fns = {"values": values, "activations": activations, "messages": messages}
    return [check_line(name, fns[name.rsplit(", ", 1)[1]]) for name in names]


# ---- schedule tables beyond 1F1B: interleaved and zero-bubble ------------------------------------------------

# The learner writes a schedule as a table, `fn(p, m, r[, v])` -> rank r's actions in order. One rank
# evaluates it for every rank (learner code); here the tables are simulated
# (`distlab.course.pipeline.simulate`): F = 1 unit, B = 2 (interleaved), or F = B = W = 1 (zero-bubble).
# Lines: complete (every action of every micro-batch once per rank), runs (no rank waits for an action
# that never comes), bubble (the simulated idle share against the closed form), and for the interleaved
# schedule memory (chunk activations in flight against Megatron-LM's warm-up).

def schedule_cases(kind: str, shapes: tuple[tuple[int, int, int], ...]) -> list[Case]:
    out = []
    for p, m, v in shapes:
        head = f"{kind}, p={p} m={m}" + (f" v={v}" if kind == "interleaved" else "")
        tail = ("complete", "runs", "bubble") + (("memory",) if kind == "interleaved" else ())
        out.append(Case(1, tuple(f"{head}, {t}" for t in tail), {"p": p, "m": m, "v": v}))
    return out


def schedule_exercise(kind: str, case: Case, fn: Any) -> list:
    p, m, v = case.args["p"], case.args["m"], case.args["v"]
    tables = [fn(p, m, r, v) if kind == "interleaved" else fn(p, m, r) for r in range(p)]
    return [[tuple(int(x) if not isinstance(x, str) else str(x) for x in a) for a in t] for t in tables]


def schedule_judge(kind: str, case: Case, outputs: list, reference: Any) -> list[Line]:
    from distlab.course.pipeline.simulate import simulate
    from distlab.course.pipeline.bubble import bubble
    from distlab.theory.pipeline import bubble_fraction, zero_bubble_fraction
    p, m, v = case.args["p"], case.args["m"], case.args["v"]
    tables = outputs[0]
    inter = kind == "interleaved"
    kinds = ("F", "B") if inter else ("F", "B", "W")
    chunks = range(v) if inter else range(1)
    state: dict[str, Any] = {}

    def complete() -> str:
        for r, t in enumerate(tables):
            want = sorted((k, i, c) for k in kinds for i in range(m) for c in chunks)
            got = sorted((a[0], a[1], a[2] if len(a) > 2 else 0) for a in t)
            expect(got == want, f"rank {r}'s table has {len(t)} actions; it must run each of "
                   f"{', '.join(kinds)} once for every micro-batch" + (" and chunk" if inter else "")
                   + f" ({len(want)} actions)")
        return f"every rank runs {' '.join(kinds)} of every micro-batch{' and chunk' if inter else ''} once"

    def runs() -> str:
        costs = dict(t_f=1, t_b=2, v=v) if inter else dict(t_f=1, t_b=1, t_w=1)
        try:
            state["spans"] = simulate(lambda p_, m_, r: tables[r], p, m, **costs)
        except ValueError as exc:
            raise CheckFailed(f"the tables deadlock: {exc}. A forward needs the previous stage's forward of "
                              "that micro-batch first, a backward the next stage's backward (and its own "
                              "forward), a W its B") from None
        return "the tables run to the end: every action's input is made before it"

    def bubble_line() -> str:
        if "spans" not in state:
            raise CheckFailed("not simulated: the tables do not run")
        got = bubble(state["spans"])
        want = bubble_fraction(p, m, v) if inter else zero_bubble_fraction(p, m)
        expect(got <= want + 1e-9, f"simulated bubble {got:.4f}; the schedule reaches {want:.4f} "
               + ("(((p - 1)/v)/(m + (p - 1)/v)): warm up 2(p - r - 1) + (v - 1)p chunk forwards, then "
                  "alternate" if inter else "(ZB-H1): run B at once, postpone up to r W's on rank r"))
        return f"simulated bubble {got:.4f} (the schedule's {want:.4f})"

    def memory() -> str:
        for r, t in enumerate(tables):
            held = peak = 0
            for a in t:
                held += 1 if a[0] == "F" else -1
                peak = max(peak, held)
            limit = min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
            expect(peak <= limit, f"rank {r} holds {peak} chunk activations at its peak; Megatron-LM's "
                   f"interleaved 1F1B holds at most {limit}: start backwards after the warm-up")
        return "each rank holds at most 2(p - r - 1) + (v - 1)p + 1 chunk activations"

    fns = {"complete": complete, "runs": runs, "bubble": bubble_line, "memory": memory}
    return [check_line(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]


# ---- predict with the planner, then measure ------------------------------------------------------------------

# `my_predictions()` for p = 4 stages, m = 8 micro-batches of 2 rows, then the learner's 1F1B measured
# there: the bytes rank 1 sends (exact), rank 0's peak (the prediction in micro-batches, plus at most one
# backward's transient), and the bubble against (p - 1)/(m + p - 1) (a timing is not graded: the
# prediction is).


def predict_exercise(case: Case, predict: Any, fn: Any) -> dict:
    out = pipeline_exercise("1f1b", Case(4, (), {"m": case.args["m"]}), fn)
    if distlab.rank() == 0:
        bubble, peak, sent = predict()
        out["predicted"] = {"bubble": {k: float(v) for k, v in dict(bubble).items()},
                            "peak": {k: float(v) for k, v in dict(peak).items()}, "sent": float(sent)}
    return out


def predict_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
    from distlab.theory.pipeline import activations_in_flight, bubble_fraction
    p, m = 4, case.args["m"]
    pred = outputs[0].get("predicted") or {}

    def bubble() -> str:
        for name in ("gpipe", "1f1b"):
            got = pred.get("bubble", {}).get(name)
            expect(got is not None and abs(got - bubble_fraction(p, m)) < 1e-6,
                   f"predicted bubble for {name}: {got}; both idle (p - 1)/(m + p - 1) of a step")
        return "GPipe and 1F1B idle (p - 1)/(m + p - 1) = 3/11 of a step"

    def peak() -> str:
        o = outputs[0]
        measured = o["peak"] / o["unit"]
        for name in ("gpipe", "1f1b"):
            got = pred.get("peak", {}).get(name)
            expect(got == activations_in_flight(name, p, m, 0),
                   f"predicted rank 0 peak for {name}: {got} micro-batches; count the forwards rank 0 runs "
                   "before its first backward, plus that one")
        expect(pred["peak"]["1f1b"] <= measured < pred["peak"]["1f1b"] + 1,
               f"your 1F1B's rank 0 peaked at {measured:.2f} micro-batches: not the predicted "
               f"{pred['peak']['1f1b']:g} plus at most one backward's transient")
        return (f"rank 0's 1F1B peak: the predicted {pred['peak']['1f1b']:g} micro-batches plus at most one "
                "backward's transient")

    def sent() -> str:
        got = outputs[1]["comm"].bytes.get("send", 0)
        expect(pred.get("sent") == got, f"predicted {pred.get('sent')} bytes sent by rank 1; it sent {got}")
        return f"rank 1 sent {got:,} bytes, as predicted"

    fns = {"bubble": bubble, "peak": peak, "bytes": sent}
    return [check_line(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]


from distlab.checks.ch08_mesh import (MESH_HINT, step_3d_cases, step_3d_exercise,  # noqa: E402 - split out
                                      step_3d_inputs, step_3d_judge, step_3d_reference)
from distlab.checks.ch08_offload import (offload_exercise, offload_inputs, offload_judge,  # noqa: E402 - split out
                                         offload_reference)


def pipeline(kind: str, answer: str, shapes: tuple[tuple[int, int], ...]) -> Row:
    """A schedule run on real stages (`kind`: forward, gpipe or 1f1b), one case per (stages p, micro-batches m)
    in `shapes`: values, (activations,) messages."""
    return task(kind, answer, pipeline_cases(kind, shapes), inputs=pipeline_inputs,
                exercise=partial(pipeline_exercise, kind), reference=partial(pipeline_reference, kind),
                judge=partial(pipeline_judge, kind), hang_hint=PIPE_1F1B_HINT if kind == "1f1b" else PIPE_HINT)


def schedule(kind: str, answer: str, shapes: tuple[tuple[int, int, int], ...]) -> Row:
    """A schedule written as a table (`kind`: interleaved or zero_bubble), simulated for each (p, m, v)."""
    return task(kind, answer, schedule_cases(kind, shapes), exercise=partial(schedule_exercise, kind),
                judge=partial(schedule_judge, kind))


def offload(kind: str, *lines: str) -> Row:
    """OffloadAdam, on one rank (`kind`: state, its construction; grads, the backward; step, full steps)."""
    return task(f"offload_{kind}", "OffloadAdam", per_ranks((1,), *(f"offload_{kind}, {line}" for line in lines)),
                inputs=partial(offload_inputs, kind), exercise=partial(offload_exercise, kind),
                reference=partial(offload_reference, kind), judge=partial(offload_judge, kind))


TASKS = table(
    pipeline("forward", "pipeline_forward", ((2, 2), (4, 4))),
    pipeline("gpipe", "gpipe_step", ((2, 4), (4, 6))),
    pipeline("1f1b", "one_f_one_b_step", ((2, 4), (4, 2), (4, 6))),
    task("predict", ("my_predictions", "one_f_one_b_step"),
         per_ranks((4,), "predict, bubble", "predict, peak", "predict, bytes", args={"m": 8}),
         exercise=predict_exercise, judge=predict_judge, hang_hint=PIPE_1F1B_HINT),
    schedule("interleaved", "interleaved_schedule", ((4, 8, 2), (2, 4, 2))),
    schedule("zero_bubble", "zero_bubble_schedule", ((4, 8, 1), (2, 4, 1))),
    task("step_3d", "step_3d", step_3d_cases(),
         inputs=step_3d_inputs, exercise=step_3d_exercise, reference=step_3d_reference, judge=step_3d_judge,
         hang_hint=MESH_HINT),
    offload("state", "host", "device"),
    offload("grads", "streamed", "released"),
    offload("step", "values", "traffic"),
)

grade = grader(TASKS)
