"""Lab 4's graded tasks: ZeRO-2 built in four steps, then its memory.

1. `buckets` — `make_buckets(params, bucket_size_mb, world_size)`: every
   trainable parameter once, in backward order; sizes, padding, offsets.
2. `construct` — `ZeRO2.__init__`: the flat parameter buffer, rank 0's
   weights broadcast, rank r owning chunk r of every bucket.
3. `backward` — `_on_grad` / `_retire`: during backward, one asynchronous
   reduce-scatter per bucket, launched as soon as the bucket's last gradient
   is final; every `p.grad` freed; the summed gradient chunks right (read
   after `_retire()`, which runs inside the same meter window).
4. `step` — `step` / `zero_grad`: the same parameters as one process on the
   whole batch (SGD, AdamW, bf16 + MixedPrecisionAdam; frozen and tied
   weights); optimizer state sharded; only reduce-scatters in backward and
   as many all-gathers in the step, 2Ψb(N-1)/N algorithmic bytes in every
   step of every recipe (each metered: the parameters after all of them are
   judged).
5. `memory` — no new code: held bytes at a step boundary are exactly
   2Ψ + 14Ψ/N (bf16 + MixedPrecisionAdam), and the memory meter's peak never
   holds a full-size gradient.

References are computed here, in the process that judges, from the same
seeded models and batches, never by the learner's code.
"""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.course.zero.buckets import describe
from distlab.checks.draws import draw_seed, drawn_batch_shards, drawn_weights, load_weights, weights_of
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import CheckFailed, compare, expect
from distlab.meters import track_comm
from distlab.course.models import lm_loss
from distlab.checks.ch04_common import (BATCH, BUCKET_MB, CONFIGS, CONFIGS_4, HANG, VARIANTS, _my_batch, _names,
                                        _params, _rank_batch, _trainable, variant_model)
from distlab.checks.ch04_step import (memory_exercise, memory_judge, memory_reference, step_exercise,
                                      step_inputs, step_judge, step_reference)


# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist

import distlab
from distlab.course.zero.buckets import GradBucket
from distlab.engine.collectives import all_gather_tensor"""

# ---- 1. make_buckets ---------------------------------------------------------------------------

BUCKET_SIZES = (0.004, 0.02, 0.1)
BUCKET_WORLDS = (1, 2, 3, 4, 8)
DTYPES = (torch.float32, torch.bfloat16)


def buckets_exercise(case: Case, make_buckets: Any) -> dict:
    out = {}
    for variant in VARIANTS:
        for dtype in DTYPES:
            model = variant_model(variant, dtype=dtype)
            names = _names(model)
            for mb in BUCKET_SIZES:
                for n in BUCKET_WORLDS:
                    distlab.engine.runtime.progress(f"make_buckets: {variant} model, {dtype}, {mb} MiB, N={n}")
                    out[variant, str(dtype), mb, n] = describe(make_buckets(model.parameters(), mb, n), names)
    return out


def buckets_reference(case: Case) -> dict:
    return {(v, str(d)): _trainable(variant_model(v, dtype=d, device="cpu")) for v in VARIANTS for d in DTYPES}


def buckets_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    out = outputs[0]
    order_line, size_line = case.lines

    def setting(key: tuple) -> str:
        variant, dtype, mb, n = key
        return f"{variant} model, {dtype.replace('torch.', '')}, bucket_size_mb={mb}, N={n}"

    def order() -> str:
        for (variant, dtype), trainable in reference.items():
            want = [name for name, _, _ in reversed(trainable)]
            for mb in BUCKET_SIZES:
                for n in BUCKET_WORLDS:
                    key = (variant, dtype, mb, n)
                    got = [name for b in out[key] for name in b["params"]]
                    if got != want:
                        raise CheckFailed(f"{setting(key)}: the buckets hold {_short(got)}; expected every trainable "
                                          f"parameter once, in reverse order of parameters(): {_short(want)}")
        return "frozen ones left out, a tied one once, reverse order of parameters()"

    def sizes() -> str:
        for (variant, dtype), trainable in reference.items():
            nbytes = {name: k * e for name, k, e in trainable}
            numel = {name: k for name, k, _ in trainable}
            for mb in BUCKET_SIZES:
                limit = mb * 2**20
                for n in BUCKET_WORLDS:
                    key = (variant, dtype, mb, n)
                    start = 0
                    for i, b in enumerate(out[key]):
                        names = b["params"]
                        at = f"{setting(key)}, bucket {i}"
                        offsets = [sum(numel[m] for m in names[:j]) for j in range(len(names))]
                        used = sum(numel[m] for m in names)
                        expect(b["offsets"] == offsets, f"{at}: offsets {b['offsets']}, expected {offsets}")
                        expect(b["used"] == used, f"{at}: used {b['used']}, expected {used}")
                        expect(b["numel"] == -(-used // n) * n and b["chunk"] * n == b["numel"],
                               f"{at}: numel {b['numel']}, chunk {b['chunk']}: pad {used} up to a multiple of N")
                        expect(b["start"] == start, f"{at}: starts at {b['start']}, expected {start} "
                               "(right after the previous bucket)")
                        start += b["numel"]
                        size = sum(nbytes[m] for m in names)
                        expect(size - nbytes[names[-1]] < limit, f"{at}: holds {size} B and was already "
                               f"{size - nbytes[names[-1]]} B before its last parameter: close a bucket as soon "
                               f"as it reaches {limit:.0f} B")
                        expect(i == len(out[key]) - 1 or size >= limit,
                               f"{at}: closed at {size} B, below bucket_size_mb ({limit:.0f} B)")
        return "buckets close at bucket_size_mb, padded to a multiple of N, laid out one after another"

    return [check_line(order_line, order), check_line(size_line, sizes)]


def _short(names: list[str]) -> str:
    return str(names) if len(names) <= 6 else f"[{', '.join(names[:3])}, ... {len(names)} in all]"


# ---- 2. ZeRO2.__init__ ---------------------------------------------------------------------------


def construct_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own (different) starting weights of each model."""
    return [{k: v for variant in VARIANTS
             for k, v in drawn_weights(variant_model(variant, seed=draw_seed(rng), device="cpu"),
                                       f"{variant}.").items()} for _ in range(case.world_size)]


def construct_exercise(case: Case, ZeRO2: Any, inputs: dict | None = None) -> dict:
    r, out = distlab.rank(), {}
    for variant in VARIANTS:
        distlab.engine.runtime.progress(f"ZeRO2(...) on the {variant} model, {case.world_size} ranks")
        model = (variant_model(variant, seed=100 + r) if inputs is None    # every rank starts different
                 else load_weights(variant_model(variant), inputs, f"{variant}."))
        names = _names(model)
        with track_comm() as comm:
            opt = ZeRO2(model.parameters(), torch.optim.SGD, bucket_size_mb=BUCKET_MB, lr=0.1)
        trainable = [p for p in model.parameters() if p.requires_grad]
        flat = trainable[0].untyped_storage()
        out[variant] = {
            "params": _params(model), "comm": comm.stats(), "buckets": describe(opt.buckets, names),
            "storages": len({p.untyped_storage().data_ptr() for p in trainable}),
            "flat_numel": flat.nbytes() // trainable[0].element_size(),
            "inner": [(q.untyped_storage().data_ptr() == flat.data_ptr(), q.storage_offset(), q.numel())
                      for g in opt.optim.param_groups for q in g["params"]],
            "grad_shards": [(b.grad_shard.numel(), str(b.grad_shard.dtype), b.grad_shard.device == trainable[0].device)
                            for b in opt.buckets],
        }
    return out


def construct_reference(case: Case, inputs: list | None = None) -> dict:
    if inputs is not None:
        return {variant: [{k: v.float() for k, v in weights_of(mine, f"{variant}.").items()} for mine in inputs]
                for variant in VARIANTS}
    return {variant: [_params(variant_model(variant, seed=100 + r, device="cpu")) for r in range(case.world_size)]
            for variant in VARIANTS}


def construct_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n = case.world_size
    weights_line, layout_line = case.lines

    def weights() -> str:
        for r, out in enumerate(outputs):
            for variant in VARIANTS:
                o, rank0, mine = out[variant], reference[variant][0], reference[variant][r]
                other = sorted(set(o["comm"].calls) - {"broadcast"})
                expect(not other, f"rank {r}, {variant} model: construction called {other}; only broadcast")
                expect(o["comm"].calls.get("broadcast", 0) >= 1, f"rank {r}, {variant} model: no broadcast")
                for k, want in rank0.items():
                    frozen = variant == "frozen" and k == "pos.weight"
                    try:
                        compare(o["params"][k], mine[k] if frozen else want, atol=0, rtol=0,
                                what=f"rank {r}'s {k}")
                    except CheckFailed as exc:
                        raise CheckFailed(f"{variant} model: {exc}" + (
                            " (a frozen parameter stays as it was)" if frozen else " (rank 0's weights: broadcast)"))
        return "trainable parameters broadcast from rank 0, frozen ones untouched"

    def layout() -> str:
        for r, out in enumerate(outputs):
            for variant in VARIANTS:
                o, at = out[variant], f"rank {r}, {variant} model"
                total = sum(b["numel"] for b in o["buckets"])
                expect(o["storages"] == 1 and o["flat_numel"] == total,
                       f"{at}: the trainable parameters live in {o['storages']} storage(s) of "
                       f"{o['flat_numel']} elements; expected views of one flat buffer of {total}")
                want = [(True, b["start"] + r * b["chunk"], b["chunk"]) for b in o["buckets"]]
                expect(o["inner"] == want, f"{at}: the inner optimizer holds (in flat buffer, offset, numel) "
                       f"{o['inner'][:4]}...; expected chunk r of every bucket: {want[:4]}...")
                for (k, dtype, placed), b in zip(o["grad_shards"], o["buckets"]):
                    expect(k == b["chunk"] and placed, f"{at}: a bucket's grad_shard has {k} elements "
                           f"(expected {b['chunk']}, on the parameters' device)")
        return "every p.data a view of one flat buffer; the inner optimizer holds this rank's chunks"

    return [check_line(weights_line, weights), check_line(layout_line, layout)]


# ---- 3. _on_grad, _retire ----------------------------------------------------------------------


def backward_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of the batch."""
    return drawn_batch_shards(rng, case.world_size, 1, BATCH)


def backward_exercise(case: Case, ZeRO2: Any, inputs: dict | None = None) -> dict:
    n, r = case.world_size, distlab.rank()
    distlab.engine.runtime.progress(f"one backward of ZeRO2 on the plain model, {n} ranks")
    model = variant_model("plain")
    names = _names(model)
    opt = ZeRO2(model.parameters(), torch.optim.SGD, bucket_size_mb=BUCKET_MB, lr=0.1)
    log: list[tuple[str, int]] = []
    with track_comm() as meter:
        for name, p in model.named_parameters():   # runs after the learner's hook on the same p
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: log.append((name, meter.calls.get("reduce_scatter", 0))))
        x, y = _my_batch(0, n, r, inputs)
        lm_loss(model, x, y).backward()
        pending = len(opt.pending)
        left = [k for k, p in model.named_parameters() if p.grad is not None]
        distlab.engine.runtime.progress(f"_retire() after backward, {n} ranks")
        opt._retire()          # inside the meter: the chunks judged come from the calls it counts
        comm = meter.stats()
    return {"log": log, "pending": pending, "comm": comm, "left": left,
            "buckets": describe(opt.buckets, names),
            "shards": [b.grad_shard.detach().float().clone() for b in opt.buckets]}


def backward_reference(case: Case, inputs: list | None = None) -> dict:
    """The sum over ranks of each rank's gradient (what the reduce-scatter adds up)."""
    n, total = case.world_size, {}
    for r in range(n):
        model = variant_model("plain", device="cpu")
        x, y = _rank_batch(0, n, r, device="cpu") if inputs is None else (inputs[r]["x0"], inputs[r]["y0"])
        lm_loss(model, x, y).backward()
        for k, p in model.named_parameters():
            total[k] = total.get(k, 0) + p.grad.detach().clone()
    return total


def backward_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    n = case.world_size
    values_line, when_line = case.lines

    def values() -> str:
        for r, out in enumerate(outputs):
            for i, (b, got) in enumerate(zip(out["buckets"], out["shards"])):
                flat = torch.zeros(b["numel"])
                for name, off in zip(b["params"], b["offsets"]):
                    g = reference[name].reshape(-1)
                    flat[off:off + g.numel()] = g
                compare(got, flat[r * b["chunk"]:(r + 1) * b["chunk"]], atol=1e-5, rtol=1e-4,
                        what=f"rank {r}'s chunk of bucket {i}'s gradient")
        return "rank r holds chunk r of every bucket's gradient, summed over the ranks"

    def when() -> str:
        for r, out in enumerate(outputs):
            buckets = [set(b["params"]) for b in out["buckets"]]
            calls = out["comm"].calls
            expect(set(calls) <= {"reduce_scatter"}, f"rank {r}: during backward and _retire() expected "
                   f"only reduce-scatters, saw {calls}")
            expect(calls.get("reduce_scatter", 0) == len(buckets) >= 2,
                   f"rank {r}: {calls.get('reduce_scatter', 0)} reduce-scatters during backward for "
                   f"{len(buckets)} buckets: one per bucket")
            seen: set[str] = set()
            for name, started in out["log"]:
                seen.add(name)
                complete = sum(1 for b in buckets if b <= seen)
                expect(started >= complete, f"rank {r}: when {name}'s gradient was final, {complete} "
                       f"bucket(s) were complete but {started} reduce-scatter(s) had started: launch each "
                       "bucket's reduce-scatter in the hook that completes it")
            expect(not out["left"], f"rank {r}: after backward {_short(out['left'])} still have p.grad: "
                   "set p.grad = None in the hook once it is copied")
            expect(out["pending"] >= 1, f"rank {r}: no reduce-scatter was still pending when backward "
                   "returned: launch them with async_op=True and wait in _retire()")
        return "launched from the hooks as each bucket completes, still on the wire at the end of backward"

    return [check_line(values_line, values), check_line(when_line, when)]


STEP_LINES = ("step, {n} ranks: optimizer state sharded",
              "step, {n} ranks: reduce-scatters in backward, all-gathers in step, 2Ψb(N-1)/N")

TASKS = table(
    task("buckets", "make_buckets",
         per_ranks((1,), "buckets: every trainable parameter once, in backward order",
                   "buckets: sizes, padding and offsets"),
         exercise=buckets_exercise, reference=buckets_reference, judge=buckets_judge,
         hang_hint="make_buckets needs no collective: call none."),
    task("construct", "ZeRO2",
         per_ranks((2, 4), "construct, {n} ranks: every rank starts from rank 0's weights",
                   "construct, {n} ranks: one flat buffer, rank r owns chunk r of every bucket"),
         inputs=construct_inputs, exercise=construct_exercise, reference=construct_reference, judge=construct_judge,
         hang_hint=HANG),
    task("backward", "ZeRO2",
         per_ranks((2, 4), "backward, {n} ranks: summed gradient chunks",
                   "backward, {n} ranks: one async reduce-scatter per bucket, gradients freed"),
         inputs=backward_inputs, exercise=backward_exercise, reference=backward_reference, judge=backward_judge,
         hang_hint=HANG),
    task("step", "ZeRO2",
         per_ranks((2,), "step, {n} ranks: matches one process (SGD, AdamW, bf16 + MixedPrecisionAdam; frozen "
                   "and tied weights)", *STEP_LINES, args={"configs": CONFIGS})
         + per_ranks((4,), "step, {n} ranks: matches one process (SGD, bf16 + MixedPrecisionAdam; tied weights)",
                     *STEP_LINES, args={"configs": CONFIGS_4}),
         inputs=step_inputs, exercise=step_exercise, reference=step_reference, judge=step_judge, hang_hint=HANG),
    task("memory", "ZeRO2",
         per_ranks((2, 4), "memory, {n} ranks: 2Ψ + 14Ψ/N bytes at a step boundary",
                   "memory, {n} ranks: never a full-size gradient (memory meter)"),
         exercise=memory_exercise, reference=memory_reference, judge=memory_judge, hang_hint=HANG),
)

grade = grader(TASKS)
