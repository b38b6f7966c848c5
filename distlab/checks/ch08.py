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

from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.task import (Case, Line, Task, draw_seed, drawn_batch_shards, drawn_weights, grader,
                                 judged, load_weights)
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

PRESET, SEED, LAYERS, MICRO = "tiny", 0, 4, 2      # 4 blocks: up to 4 stages; 2 rows per micro-batch
OFFLOAD_LR, OFFLOAD_WD, OFFLOAD_STEPS, OFFLOAD_BATCH = 5e-2, 0.1, 3, 8

PIPE_HINT = ("A pipeline hangs when a rank waits for a message its neighbour never sends: every recv "
             "needs a send of the same shape, in the same order, on the neighbour. In 1F1B, post the send "
             "of a forward's output together with the receive of the next gradient (dist.batch_isend_irecv).")


def _batch(m: int, config: Any, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    from distlab.course.models import synthetic_batch
    return synthetic_batch(0, MICRO * m, config, device=device)


# ---- drawn inputs (grading only): a stage gets its own weights, the first stage the tokens, the last the targets

def _drawn_stages(rng: torch.Generator, stages: int, rows: int, n_layers: int) -> tuple[list, torch.Tensor,
                                                                                      torch.Tensor]:
    """(each stage's weights under "w.", the tokens, the targets) of a model and a batch from drawn seeds."""
    from distlab.course.models import build_model, synthetic_batch
    from distlab.course.pipeline.stages import Stage
    model = build_model(PRESET, seed=draw_seed(rng), n_layers=n_layers, device="cpu")
    x, y = synthetic_batch(0, rows, model.config, seed=draw_seed(rng), device="cpu")
    return [drawn_weights(Stage(model, s, stages), "w.") for s in range(stages)], x, y


def _model_of_stages(weights: list[dict[str, torch.Tensor]], n_layers: int) -> torch.nn.Module:
    """In the grader: the whole model with each stage's drawn weights (`weights[s]`: stage s's inputs)."""
    from distlab.course.models import build_model
    from distlab.course.pipeline.stages import Stage
    model = build_model(PRESET, seed=SEED, n_layers=n_layers, device="cpu")
    for s, mine in enumerate(weights):
        load_weights(Stage(model, s, len(weights)), mine, "w.")
    return model


def _stage_batch(inputs: dict[str, torch.Tensor], rows: int, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """On a rank: its drawn tokens and targets where it has them; elsewhere zeros of their shape (only
    their shape is read: `activation_bytes` on a middle stage; the learner gets None for them)."""
    dev = distlab.device()
    blank = torch.zeros(rows, config.seq_len, dtype=torch.long)
    return inputs.get("x", blank).to(dev), inputs.get("y", blank).to(dev)


class PipelineTask(Task):
    """`kind`: 'forward' (inference only), 'gpipe' or '1f1b'."""

    hang_hint = PIPE_HINT

    def __init__(self, kind: str, answer: str, cases: tuple[tuple[int, int], ...]) -> None:
        self.name = self.kind = kind
        self.answers = (answer,)
        self._cases = cases

    def cases(self) -> list[Case]:
        out = []
        for p, m in self._cases:
            head = f"{self.kind}, {p} stages, m={m}"
            lines = (f"{head}, values", f"{head}, messages") if self.kind == "forward" else (
                f"{head}, values", f"{head}, activations", f"{head}, messages")
            out.append(Case(p, lines, {"m": m}))
        return out

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Under grading: rank r's stage weights; the tokens to rank 0 only, the targets to the last rank only."""
        p = case.world_size
        out, x, y = _drawn_stages(rng, p, MICRO * case.args["m"], LAYERS)
        out[0]["x"], out[p - 1]["y"] = x, y
        return out

    # -- on every rank, with the learner's function ------------------------------------------------
    def exercise(self, case: Case, fn: Any, inputs: dict | None = None) -> dict:
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
        if self.kind != "forward":
            distlab.engine.runtime.progress(f"{p} stages, m={m}: measuring one micro-batch")
            unit = activation_bytes(stage, x[:MICRO], y[:MICRO])
            for q in stage.parameters():
                q.grad = torch.zeros_like(q)      # gradients accumulate in place: not activations
        distlab.engine.runtime.progress(f"{self.kind}, {p} stages, m={m}")
        with track_memory() as mem, track_comm() as comm:
            if self.kind == "forward":
                with torch.no_grad():
                    out = fn(stage, x if first else None, m, MICRO)
            else:
                out = fn(stage, x if first else None, y if last else None, m, MICRO)
        if isinstance(out, torch.Tensor):
            out = out.detach().float().cpu()
        grads = {} if self.kind == "forward" else {
            stage.full_names[n]: (q.grad.detach().clone() if q.grad is not None else None)
            for n, q in stage.named_parameters()}
        return {"out": out if last else None, "grads": grads, "peak": int(mem.peak_bytes), "unit": unit,
                "comm": comm.stats()}

    # -- here, without learner code ----------------------------------------------------------------
    def reference(self, case: Case, inputs: list | None = None) -> dict:
        from distlab.course.models import build_model, lm_loss
        if inputs is None:
            model = build_model(PRESET, seed=SEED, n_layers=LAYERS, device="cpu")
            x, y = _batch(case.args["m"], model.config, device="cpu")
        else:
            model = _model_of_stages(inputs, LAYERS)
            x, y = inputs[0]["x"], inputs[-1]["y"]
        if self.kind == "forward":
            with torch.no_grad():
                return {"out": model(x).float(), "grads": {}}
        loss = lm_loss(model, x, y)
        loss.backward()
        return {"out": loss.detach(), "grads": {n: q.grad.clone() for n, q in model.named_parameters()},
                "act_bytes": MICRO * model.config.seq_len * model.config.d_model * 4}

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        p, m = case.world_size, case.args["m"]
        names = case.lines

        def values() -> str:
            out = outputs[p - 1]["out"]
            expect(out is not None, f"the last rank (rank {p - 1}) returned None: it must return the "
                   + ("logits of the whole batch" if self.kind == "forward" else "mean loss"))
            mine = torch.as_tensor(out, dtype=torch.float32)
            if self.kind != "forward":
                mine = mine.reshape(())
            compare(mine, reference["out"].float(), atol=1e-5, rtol=1e-4,
                    what="the last rank's " + ("logits" if self.kind == "forward" else "loss"))
            if self.kind == "forward":
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
                want = m if self.kind == "gpipe" else min(m, p - r)
                if held > want + 1.0:
                    raise CheckFailed(f"rank {r} held {held:.1f} micro-batches of activations at its peak; "
                                      f"{self.kind} holds at most {want}"
                                      + ("" if self.kind == "gpipe" else
                                         ": start each backward as soon as its gradient can arrive"))
                if self.kind == "gpipe" and held < m - 0.5:
                    raise CheckFailed(f"rank {r} held {held:.1f} micro-batches at its peak; GPipe runs every "
                                      f"forward before any backward and holds all m = {m}")
            return ("holds all m micro-batches' activations" if self.kind == "gpipe"
                    else "holds at most p - r micro-batches' activations on rank r")

        def messages() -> str:
            act = reference.get("act_bytes", MICRO * 16 * 32 * 4)
            for r, o in enumerate(outputs):
                stats = o["comm"]
                other = sorted(set(stats.calls) - {"send", "recv"})
                expect(not other, f"rank {r} called {', '.join(other)}: a pipeline uses only send/recv")
                links = (r < p - 1) + (0 if self.kind == "forward" else (r > 0))
                sends, sent = stats.calls.get("send", 0), stats.bytes.get("send", 0)
                recvs = stats.calls.get("recv", 0)
                want_recvs = (r > 0) + (0 if self.kind == "forward" else (r < p - 1))
                expect(sends == m * links and recvs == m * want_recvs,
                       f"rank {r} posted {sends} sends and {recvs} receives; expected {m * links} and "
                       f"{m * want_recvs} (one message per micro-batch and direction)")
                expect(sent == m * links * act,
                       f"rank {r} sent {sent} bytes; expected {m * links * act} (one activation of "
                       f"{act} bytes per message)")
            return "one activation per micro-batch and direction, send/recv only"

        fns = {"values": values, "activations": activations, "messages": messages}
        return [judged(name, fns[name.rsplit(", ", 1)[1]]) for name in names]


# ---- offload -------------------------------------------------------------------------------------

def _offload_model(seed: int = SEED, device: Any = None) -> Any:
    from distlab.course.models import build_model
    return build_model(PRESET, seed=seed, device=device).to(torch.bfloat16)


def _offload_start(inputs: dict | None) -> tuple[Any, Any]:
    """On the rank: the bf16 model (its drawn starting weights under grading) and step s's batch, `batch(s)`."""
    from distlab.course.models import synthetic_batch
    model = _offload_model()
    if inputs is None:
        return model, lambda step: synthetic_batch(step, OFFLOAD_BATCH, model.config)
    load_weights(model, inputs, "w.")
    dev = distlab.device()
    return model, lambda step: (inputs[f"x{step}"].to(dev), inputs[f"y{step}"].to(dev))


def _plain_offload_reference(inputs: dict | None = None) -> dict:
    """MixedPrecisionAdam on the rank's device: what the offloaded optimizer must reproduce (from the drawn
    `inputs` under grading, all of them: one rank)."""
    from distlab.course.models import lm_loss
    from distlab.engine.precision import MixedPrecisionAdam
    model, batch = _offload_start(inputs)
    opt = MixedPrecisionAdam(model.parameters(), lr=OFFLOAD_LR, weight_decay=OFFLOAD_WD)
    for step in range(OFFLOAD_STEPS):
        x, y = batch(step)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: q.detach().clone() for n, q in model.named_parameters()}


class OffloadTask(Task):
    """`kind`: 'state' (construction), 'grads' (the backward), 'step' (three full steps)."""

    def __init__(self, kind: str, lines: tuple[str, ...]) -> None:
        self.name, self.kind, self.answers = f"offload_{kind}", kind, ("OffloadAdam",)
        self._lines = lines

    def cases(self) -> list[Case]:
        return [Case(1, tuple(f"{self.name}, {line}" for line in self._lines))]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]] | None:
        """Under grading, for the tasks that train: drawn starting weights and each step's batch."""
        if self.kind == "state":
            return None
        steps = 1 if self.kind == "grads" else OFFLOAD_STEPS
        mine = drawn_weights(_offload_model(draw_seed(rng), device="cpu"), "w.")
        return [{**mine, **drawn_batch_shards(rng, 1, steps, OFFLOAD_BATCH, PRESET)[0]}]

    def exercise(self, case: Case, cls: Any, inputs: dict | None = None) -> dict:
        from distlab.course.models import lm_loss, num_params
        from distlab.course.offload import host_device_split, track_transfers
        model, batch = _offload_start(inputs)
        psi = num_params(model)
        distlab.engine.runtime.progress(f"offload_{self.kind}: building the optimizer")
        opt = cls(model.parameters(), lr=OFFLOAD_LR, weight_decay=OFFLOAD_WD)
        out: dict[str, Any] = {"psi": psi}
        if self.kind == "state":
            out["split"] = host_device_split(model, opt)
            return out
        steps = 1 if self.kind == "grads" else OFFLOAD_STEPS
        out["steps"] = []
        for step in range(steps):
            distlab.engine.runtime.progress(f"offload_{self.kind}: step {step}")
            x, y = batch(step)
            with track_transfers(model) as backward:
                lm_loss(model, x, y).backward()
            left = [n for n, q in model.named_parameters() if q.grad is not None]
            rec = {"backward": backward.stats(), "grads_left": left}
            if self.kind == "step":
                with track_transfers(model) as stepped:
                    opt.step()
                rec["step"] = stepped.stats()
            out["steps"].append(rec)
        if self.kind == "step":
            out["params"] = {n: q.detach().clone() for n, q in model.named_parameters()}
        return out

    def reference(self, case: Case, inputs: list | None = None) -> Any:
        if self.kind != "step":
            return None
        from distlab.engine.launch import launch
        return launch(_plain_offload_reference, 1, args=(None if inputs is None else inputs[0],))[0]

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
        o = outputs[0]
        psi = o["psi"]
        names = case.lines

        def host() -> str:
            split = o["split"]
            expect(split["host"] >= 12 * psi,
                   f"the optimizer keeps {split['host'] / psi:.1f} bytes per parameter off the model; the fp32 "
                   "master weights, m and v alone are 12 per parameter: make them in __init__, on the host")
            expect(split["host"] <= 18 * psi,
                   f"the optimizer keeps {split['host'] / psi:.1f} bytes per parameter on the host; more than "
                   "master, m, v (12) plus one fp32 gradient buffer and one 16-bit staging buffer (6)")
            return "fp32 master weights, m and v live on the host"

        def device() -> str:
            split = o["split"]
            expect(split["device"] <= 2 * psi,
                   f"{split['device']} bytes on the device for {psi} parameters: only the 16-bit parameters "
                   "(2 bytes each) may stay there")
            return "only the 16-bit parameters stay on the device"

        def streamed() -> str:
            for k, rec in enumerate(o["steps"]):
                b = rec["backward"]
                expect(b["down_bytes"] == 2 * psi,
                       f"step {k}: {b['down_bytes']} bytes went device -> host during the backward; expected "
                       f"2Ψ = {2 * psi} (every 16-bit gradient once, copied with copy_ into a host buffer)")
                expect(b["up_bytes"] == 0, f"step {k}: {b['up_bytes']} bytes went host -> device during the "
                       "backward; parameters go up after the step")
            return "every gradient went to the host during the backward: 2Ψ bytes"

        def released() -> str:
            for k, rec in enumerate(o["steps"]):
                left = rec["grads_left"]
                if left:
                    raise CheckFailed(f"step {k}: after the backward {len(left)} parameters still hold a device "
                                      f"gradient (e.g. {left[0]}): set p.grad = None once it is copied")
            return "no gradient left on the device after the backward"

        def values() -> str:
            for name, want in reference.items():
                mine = o["params"][name]
                expect(mine.dtype == want.dtype, f"{name} is {mine.dtype}; the parameters must stay {want.dtype}")
                compare(mine.double(), want.double(), atol=1e-6, rtol=2.0 ** -7, what=f"parameter {name}")
            return (f"parameters equal MixedPrecisionAdam's after {OFFLOAD_STEPS} steps "
                    "(to one bf16 rounding)")

        def traffic() -> str:
            for k, rec in enumerate(o["steps"]):
                s = rec["step"]
                expect(s["up_bytes"] == 2 * psi,
                       f"step {k}: {s['up_bytes']} bytes went host -> device in step(); expected 2Ψ = {2 * psi} "
                       "(every parameter once, in 16 bits: cast on the host, then copy)")
                expect(s["down_bytes"] == 0, f"step {k}: {s['down_bytes']} bytes went device -> host in step(); "
                       "the gradients are already on the host")
            return "2Ψ bytes down during the backward and 2Ψ up after each step"

        fns = {"host": host, "device": device, "streamed": streamed, "released": released,
               "values": values, "traffic": traffic}
        return [judged(name, fns[name.rsplit(", ", 1)[1]]) for name in names]


# ---- schedule tables beyond 1F1B: interleaved and zero-bubble ------------------------------------------------

class TableTask(Task):
    """The learner writes a schedule as a table, `fn(p, m, r[, v])` -> rank r's actions in order. One rank
    evaluates it for every rank (learner code); here the tables are simulated
    (`distlab.course.pipeline.simulate`): F = 1 unit, B = 2 (interleaved), or F = B = W = 1 (zero-bubble).
    Lines: complete (every action of every micro-batch once per rank), runs (no rank waits for an action
    that never comes), bubble (the simulated idle share against the closed form), and for the interleaved
    schedule memory (chunk activations in flight against Megatron-LM's warm-up)."""

    def __init__(self, kind: str, answer: str, cases: tuple[tuple[int, int, int], ...]) -> None:
        self.name = self.kind = kind
        self.answers = (answer,)
        self._cases = cases

    def cases(self) -> list[Case]:
        out = []
        for p, m, v in self._cases:
            head = f"{self.kind}, p={p} m={m}" + (f" v={v}" if self.kind == "interleaved" else "")
            tail = ("complete", "runs", "bubble") + (("memory",) if self.kind == "interleaved" else ())
            out.append(Case(1, tuple(f"{head}, {t}" for t in tail), {"p": p, "m": m, "v": v}))
        return out

    def exercise(self, case: Case, fn: Any) -> list:
        p, m, v = case.args["p"], case.args["m"], case.args["v"]
        tables = [fn(p, m, r, v) if self.kind == "interleaved" else fn(p, m, r) for r in range(p)]
        return [[tuple(int(x) if not isinstance(x, str) else str(x) for x in a) for a in t] for t in tables]

    def reference(self, case: Case) -> None:
        return None

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
        from distlab.course.pipeline.simulate import simulate
        from distlab.course.pipeline.stages import bubble
        from distlab.theory.pipeline import bubble_fraction, zero_bubble_fraction
        p, m, v = case.args["p"], case.args["m"], case.args["v"]
        tables = outputs[0]
        inter = self.kind == "interleaved"
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
        return [judged(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]


# ---- predict with the planner, then measure ------------------------------------------------------------------

class PredictTask(Task):
    """`my_predictions()` for p = 4 stages, m = 8 micro-batches of 2 rows, then the learner's 1F1B measured
    there: the bytes rank 1 sends (exact), rank 0's peak (the prediction in micro-batches, plus at most one
    backward's transient), and the bubble against (p - 1)/(m + p - 1) (a timing is not graded: the
    prediction is)."""

    name = "predict"
    answers = ("my_predictions", "one_f_one_b_step")
    hang_hint = PIPE_HINT

    def cases(self) -> list[Case]:
        return [Case(4, ("predict, bubble", "predict, peak", "predict, bytes"), {"m": 8})]

    def exercise(self, case: Case, predict: Any, fn: Any) -> dict:
        out = PipelineTask("1f1b", "", ()).exercise(Case(4, (), {"m": case.args["m"]}), fn)
        if distlab.rank() == 0:
            bubble, peak, sent = predict()
            out["predicted"] = {"bubble": {k: float(v) for k, v in dict(bubble).items()},
                                "peak": {k: float(v) for k, v in dict(peak).items()}, "sent": float(sent)}
        return out

    def reference(self, case: Case) -> None:
        return None

    def judge(self, case: Case, outputs: list, reference: Any) -> list[Line]:
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
        return [judged(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]


# ---- a 2 x 2 x 2 step: pp x dp x tp on one mesh ---------------------------------------------------------------

MESH_SHAPE, MESH_M, MESH_LAYERS = (2, 2, 2), 2, 2     # (pp, dp, tp); 2 micro-batches; one block per stage

MESH_HINT = ("In the mesh, a stage's pipeline neighbours are the ranks before and after it in its pp group "
             "(dist.get_process_group_ranks(groups['pp'])), not rank r - 1 and r + 1: with tp innermost, "
             "rank r + 1 is your tp partner. Every recv needs a send of the same shape on that neighbour.")


class Mesh3DTask(Task):
    """`step_3d(stage, groups, x, y, m, micro_batch)` on 8 ranks, a (pp, dp, tp) = 2 x 2 x 2 mesh in the
    course's order (`distlab.course.pipeline.mesh3d.MESH_ORDER`). Each rank gets its stage of the 2-block
    "tiny" model (fp32) with its blocks cut over its tp group (`tp_stage`: Megatron's f and g inside),
    its groups, and its dp replica's m micro-batches (tokens on the first stage, targets on the last).
    The learner runs the pipeline between the stage's pp neighbours and averages the gradients over dp.

    Lines: values (the last stage's loss, the replica's mean, and every rank's gradient, its tp slice,
    equal one process's on the whole global batch); pp (send/recv only between pipeline neighbours: one
    activation per micro-batch and link, exactly its bytes); dp (the gradients' average: 2(dp - 1)/dp of
    the stage's gradient bytes in the dp group, all-reduce or reduce-scatter + all-gather, no other group);
    tp (the stage's own f and g: 4 all-reduces per block and micro-batch in the tp group, exactly)."""

    name = "step_3d"
    answers = ("step_3d",)
    hang_hint = MESH_HINT

    def cases(self) -> list[Case]:
        pp, dp, tp = MESH_SHAPE
        head = f"step_3d, (pp, dp, tp) = ({pp}, {dp}, {tp}), m={MESH_M}"
        return [Case(pp * dp * tp, tuple(f"{head}, {k}" for k in ("values", "pp", "dp", "tp")),
                     {"shape": MESH_SHAPE, "m": MESH_M})]

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Under grading: every rank its stage's weights (whole: `tp_stage` cuts them); a first-stage rank its dp
        replica's tokens, a last-stage rank its replica's targets. Ranks in `distlab.mesh`'s row-major order."""
        pp, dp, tp = case.args["shape"]
        rows = case.args["m"] * MICRO
        weights, x, y = _drawn_stages(rng, pp, dp * rows, MESH_LAYERS)
        out = []
        for r in range(pp * dp * tp):
            s, d = r // (dp * tp), r // tp % dp
            mine = dict(weights[s])
            if s == 0:
                mine["x"] = x[d * rows:(d + 1) * rows]
            if s == pp - 1:
                mine["y"] = y[d * rows:(d + 1) * rows]
            out.append(mine)
        return out

    def exercise(self, case: Case, fn: Any, inputs: dict | None = None) -> dict:
        from distlab.course.pipeline.mesh3d import MESH_ORDER, tp_stage
        from distlab.course.pipeline.stages import build_stage
        from distlab.course.tensor_parallel.model import track_comm_by_group
        pp, dp, tp = case.args["shape"]
        m = case.args["m"]
        mesh = distlab.mesh(pp, dp, tp, names=MESH_ORDER)
        coord = dict(zip(MESH_ORDER, mesh.get_coordinate()))
        groups = {n: mesh.get_group(n) for n in MESH_ORDER}
        ranks = {n: tuple(dist.get_process_group_ranks(g)) for n, g in groups.items()}
        s = coord["pp"]
        whole = build_stage(PRESET, s, pp, seed=SEED, n_layers=MESH_LAYERS)
        if inputs is None:
            x, y = _batch(dp * m, whole.config)
            rows = slice(coord["dp"] * m * MICRO, (coord["dp"] + 1) * m * MICRO)
            x, y = x[rows], y[rows]
        else:
            load_weights(whole, inputs, "w.")
            x, y = _stage_batch(inputs, m * MICRO, whole.config)
        stage = tp_stage(whole, groups["tp"])
        distlab.engine.runtime.progress(f"step_3d on {pp} x {dp} x {tp}: stage {s}")
        with track_comm_by_group() as meter:
            loss = fn(stage, groups, x if s == 0 else None, y if s == pp - 1 else None, m, MICRO)
        label = {r: n for n, r in ranks.items()}
        comm = {label.get(g, "ranks " + ", ".join(map(str, g))): dict(v) for g, v in meter.stats().items()}
        calls = {label.get(g, "ranks " + ", ".join(map(str, g))): dict(v) for g, v in meter.calls_by_group.items()}
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().cpu().reshape(-1)[0].item() if loss.numel() else None
        grads = {name: [full, dim, blocks, q.grad.detach().float().cpu().clone() if q.grad is not None else None]
                 for (name, q), (full, dim, blocks) in
                 ((nq, stage.cuts[nq[0]]) for nq in stage.named_parameters())}
        return {"coord": coord, "ranks": {n: list(r) for n, r in ranks.items()}, "loss": loss, "grads": grads,
                "comm": comm, "calls": calls, "d_model": stage.config.d_model, "seq_len": stage.config.seq_len,
                "blocks": len(stage.blocks)}

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        from distlab.course.models import build_model, lm_loss
        pp, dp, tp = case.args["shape"]
        m = case.args["m"]
        if inputs is None:
            model = build_model(PRESET, seed=SEED, n_layers=MESH_LAYERS, device="cpu")
            x, y = _batch(dp * m, model.config, device="cpu")
        else:             # stage s's weights from its first rank; the replicas' rows in dp order
            model = _model_of_stages([inputs[s * dp * tp] for s in range(pp)], MESH_LAYERS)
            x = torch.cat([inputs[d * tp]["x"] for d in range(dp)])
            y = torch.cat([inputs[(pp - 1) * dp * tp + d * tp]["y"] for d in range(dp)])
        lm_loss(model, x, y).backward()
        with torch.no_grad():
            replica = [lm_loss(model, x[d * m * MICRO:(d + 1) * m * MICRO], y[d * m * MICRO:(d + 1) * m * MICRO]).item()
                       for d in range(dp)]
        return {"grads": {n: q.grad.clone() for n, q in model.named_parameters()}, "replica_loss": replica}

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        from distlab.course.pipeline.mesh3d import cut
        pp, dp, tp = case.args["shape"]
        m = case.args["m"]

        def values() -> str:
            for r, o in enumerate(outputs):
                s, d, t = o["coord"]["pp"], o["coord"]["dp"], o["coord"]["tp"]
                if s == pp - 1:
                    expect(o["loss"] is not None, f"rank {r} (last stage) returned None: it must return the mean "
                           "loss of its dp replica's rows")
                    compare(torch.tensor(float(o["loss"])), torch.tensor(reference["replica_loss"][d]),
                            atol=1e-5, rtol=1e-4, what=f"rank {r}'s loss (dp replica {d})")
                for name, (full, dim, blocks, g) in o["grads"].items():
                    want = reference["grads"][full]
                    if dim is not None:
                        want = cut(want, t, tp, dim, blocks)
                    expect(g is not None and bool(g.abs().sum() > 0),
                           f"rank {r}: {name} has no gradient: run the backward of every micro-batch")
                    try:
                        compare(g, want, atol=1e-5, rtol=1e-4, what=f"rank {r}'s gradient of {name} ({full}"
                                + (f", tp slice {t}" if dim is not None else "") + ")")
                    except CheckFailed as exc:
                        raise CheckFailed(f"{exc}; the gradient must be the mean over the dp replicas (all-reduce "
                                          "in the dp group, divided by its size) of each replica's mean over its "
                                          "micro-batches (each loss scaled by 1/m)") from None
            return "every rank's loss and gradient (its tp slice) equal one process's on the global batch"

        def pp_line() -> str:
            for r, o in enumerate(outputs):
                s = o["coord"]["pp"]
                act = MICRO * o["seq_len"] * o["d_model"] * 4
                sends = sum(c.get("send", 0) for c in o["calls"].values())
                recvs = sum(c.get("recv", 0) for c in o["calls"].values())
                sent = sum(c.get("send", 0) for c in o["comm"].values())
                links = (s > 0) + (s < pp - 1)
                expect(sends == m * links and recvs == m * links,
                       f"rank {r} (stage {s}) posted {sends} sends and {recvs} receives; expected {m * links} of "
                       "each (one activation forward, one gradient back per micro-batch and link)")
                expect(sent == m * links * act, f"rank {r} sent {sent} bytes point to point; expected "
                       f"{m * links * act} (one activation of {act} bytes per message)")
            return "one activation per micro-batch and direction between pipeline neighbours"

        def dp_line() -> str:
            for r, o in enumerate(outputs):
                extra = sorted(g for g, c in o["comm"].items()
                               if g not in ("dp", "tp") and any(k not in ("send", "recv") for k in c))
                if extra:
                    raise CheckFailed(f"rank {r} ran a collective in the group of {extra[0]}: average the gradients "
                                      "in the dp group only (a tp group holds different slices, the other stages "
                                      "different layers)")
                grad_bytes = sum(g.numel() * 4 for _, _, _, g in o["grads"].values() if g is not None)
                want = 2 * grad_bytes * (dp - 1) / dp
                got = sum(o["comm"].get("dp", {}).values())
                expect(want <= got <= want * 1.01 + 64,
                       f"rank {r} sent {got} bytes in its dp group; averaging its {grad_bytes} bytes of gradients "
                       f"moves 2(dp - 1)/dp of them: {want:.0f} (one all-reduce, or a reduce-scatter and an "
                       "all-gather)")
            return "the gradients averaged in the dp group: 2(dp - 1)/dp of their bytes, no other group"

        def tp_line() -> str:
            for r, o in enumerate(outputs):
                act = MICRO * o["seq_len"] * o["d_model"] * 4
                want = m * 4 * o["blocks"] * act * 2 * (tp - 1) // tp
                got = o["comm"].get("tp", {})
                expect(set(got) <= {"all_reduce"} and got.get("all_reduce", 0) == want,
                       f"rank {r} sent {sum(got.values())} bytes in its tp group ({', '.join(sorted(got)) or 'none'}); "
                       f"the stage's f and g move {want}: 4 all-reduces per block per micro-batch, forward and "
                       "backward once each (no collective of your own in tp)")
            return "the blocks' f and g: 4 all-reduces per block and micro-batch in the tp group"

        fns = {"values": values, "pp": pp_line, "dp": dp_line, "tp": tp_line}
        return [judged(name, fns[name.rsplit(", ", 1)[1]]) for name in case.lines]


TASKS = {t.name: t for t in (
    PipelineTask("forward", "pipeline_forward", ((2, 2), (4, 4))),
    PipelineTask("gpipe", "gpipe_step", ((2, 4), (4, 6))),
    PipelineTask("1f1b", "one_f_one_b_step", ((2, 4), (4, 2), (4, 6))),
    PredictTask(),
    TableTask("interleaved", "interleaved_schedule", ((4, 8, 2), (2, 4, 2))),
    TableTask("zero_bubble", "zero_bubble_schedule", ((4, 8, 1), (2, 4, 1))),
    Mesh3DTask(),
    OffloadTask("state", ("host", "device")),
    OffloadTask("grads", ("streamed", "released")),
    OffloadTask("step", ("values", "traffic")),
)}

grade = grader(TASKS)
