"""Lab 8's offload tasks: where the optimizer's state lives, gradients streamed to the host during the
backward, and the offloaded step's values and traffic (one rank, the course GPT in bf16). `ch08` lists them."""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_batch_shards, drawn_weights, load_weights
from distlab.checks.task import Case, Line, check_line, on_one_rank
from distlab.checks.verdict import CheckFailed, compare, expect

from distlab.checks.ch08_common import OFFLOAD_BATCH, OFFLOAD_LR, OFFLOAD_STEPS, OFFLOAD_WD, PRESET, SEED


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


# `kind`: 'state' (construction), 'grads' (the backward), 'step' (three full steps).

def offload_inputs(kind: str, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]] | None:
    """Under grading, for the tasks that train: drawn starting weights and each step's batch."""
    if kind == "state":
        return None
    steps = 1 if kind == "grads" else OFFLOAD_STEPS
    mine = drawn_weights(_offload_model(draw_seed(rng), device="cpu"), "w.")
    return [{**mine, **drawn_batch_shards(rng, 1, steps, OFFLOAD_BATCH, PRESET)[0]}]


def offload_exercise(kind: str, case: Case, cls: Any, inputs: dict | None = None) -> dict:
    from distlab.course.models import lm_loss, num_params
    from distlab.course.offload import host_device_split, track_transfers
    model, batch = _offload_start(inputs)
    psi = num_params(model)
    distlab.engine.runtime.progress(f"offload_{kind}: building the optimizer")
    opt = cls(model.parameters(), lr=OFFLOAD_LR, weight_decay=OFFLOAD_WD)
    out: dict[str, Any] = {"psi": psi}
    if kind == "state":
        out["split"] = host_device_split(model, opt)
        return out
    steps = 1 if kind == "grads" else OFFLOAD_STEPS
    out["steps"] = []
    for step in range(steps):
        distlab.engine.runtime.progress(f"offload_{kind}: step {step}")
        x, y = batch(step)
        with track_transfers(model) as backward:
            lm_loss(model, x, y).backward()
        left = [n for n, q in model.named_parameters() if q.grad is not None]
        rec = {"backward": backward.stats(), "grads_left": left}
        if kind == "step":
            with track_transfers(model) as stepped:
                opt.step()
            rec["step"] = stepped.stats()
        out["steps"].append(rec)
    if kind == "step":
        out["params"] = {n: q.detach().clone() for n, q in model.named_parameters()}
    return out


def offload_reference(kind: str, case: Case, inputs: list | None = None) -> Any:
    if kind != "step":
        return None
    return on_one_rank(_plain_offload_reference, None if inputs is None else inputs[0])


def offload_judge(kind: str, case: Case, outputs: list, reference: Any) -> list[Line]:
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
    return [check_line(name, fns[name.rsplit(", ", 1)[1]]) for name in names]
