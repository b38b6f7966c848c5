"""Chapter 8, section 8: the harness around the lecture's offloaded optimizer (which the notebook writes).

    res = distlab.launch(offload_demo, 1, args=(ShadowOffload, "tiny", 2))[0]
    res["moved"]            # per step: bytes copied device -> host in the backward, host -> device in the step

It trains the lecture's class beside `MixedPrecisionAdam` on the device, meters the copies between device and
host (`distlab.course.offload.track_transfers`), the timeline of one step and each side's bytes. One rank:
nothing crosses a network, only the host link.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from distlab.course.models import build_model, lm_loss, num_params, synthetic_batch
from distlab.course.offload import host_device_split, track_transfers
from distlab.engine import runtime as rt
from distlab.engine.precision import MixedPrecisionAdam
from distlab.meters import Timeline, track_memory


def offload_demo(offload: type, preset: str, steps: int) -> dict[str, Any]:
    """Model `preset` in bf16 trained by `offload(params, timeline=, lr=)` (the lecture's ZeRO-Offload) beside
    the same model with `MixedPrecisionAdam` on the device, on the same batches.

    Returns `psi`; `moved`: per step, the bytes copied device -> host during the backward and host ->
    device during the optimizer step (`track_transfers`); `same`: whether the parameters came out
    identical; `spans`: the last step's timeline (backward, gradient copies, host Adam); `overlap`: the
    share of the copies' time inside the backward (`copies_inside`; None if no copy span); `peaks`: peak
    bytes of one more step of each under `track_memory`; "offload" and "plain": bytes each keeps on
    the device and on the host (`host_device_split`). One rank; nothing crosses a network.
    """
    model = build_model(preset, seed=0).to(torch.bfloat16)
    plain_model = build_model(preset, seed=0).to(torch.bfloat16)
    tl = Timeline()
    opt = offload(model.parameters(), timeline=tl, lr=1e-3)
    plain = MixedPrecisionAdam(plain_model.parameters(), lr=1e-3)
    moved = []
    for step in range(steps):
        x, y = synthetic_batch(step, 8, model.config)
        tl.finish().clear()                                  # keep the last step only
        with track_transfers(model) as down:
            with tl.span("backward"):
                lm_loss(model, x, y).backward()
        with track_transfers(model) as up:
            with tl.span("host Adam + copy up"):
                opt.step()
        lm_loss(plain_model, x, y).backward()
        plain.step()
        if step < steps - 1:
            plain.zero_grad(set_to_none=True)          # the last step's gradients stay: the plain peak
        moved.append((down.stats()["down_bytes"], up.stats()["up_bytes"]))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    last = tl.finish()
    overlap = copies_inside(last, "copy down", "backward")
    split = {"offload": host_device_split(model, opt), "plain": host_device_split((plain_model, plain))}
    plain.zero_grad(set_to_none=True)
    opt.timeline = None                           # the timeline shows the last step above, not this one
    peaks = {}                                    # one more step of each under the memory meter
    for name, m_, step_fn in (("offload", model, opt.step), ("plain", plain_model, plain.step)):
        with track_memory() as mem:               # CUDA: allocator statistics; CPU: every tensor, host too
            lm_loss(m_, x, y).backward()
            step_fn()
        peaks[name] = mem.peak_bytes
    return {"psi": num_params(model), "moved": moved, "same": same, "spans": last, "backend": rt.backend(),
            "peaks": peaks, "overlap": overlap, **split}


def copies_inside(spans: Sequence[Any], copy: str, window: str) -> float | None:
    """Share of the seconds spent in spans named `copy` that fall inside the span named `window`
    (None when there are no such copies, e.g. on a GPU, where they run on the copy engine unseen)."""
    rows = [s if isinstance(s, Mapping) else s.__dict__ for s in spans]
    win = [(r["start"], r["end"]) for r in rows if r["name"] == window]
    cps = [(r["start"], r["end"]) for r in rows if r["name"] == copy]
    total = sum(e - s for s, e in cps)
    if not win or total <= 0:
        return None
    a, b = win[0]
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in cps) / total
