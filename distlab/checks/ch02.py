"""Lab 2's graded tasks: naive, overlapped and bucketed data parallelism.

Each wrapper task trains the `"frozen"` and the `"tied"` model
(`distlab.course.data_parallel.reference`) for four SGD steps (two in quick mode) on 2 and on 4 ranks and returns the
parameters and every step's collectives, counted by the comm meter in two
windows: during `backward()` and during `finish_gradient_synchronization()`.
On 2 ranks it first wraps a model built from a different seed on every rank,
the construction metered too.
The verdict lines:

- initial broadcast: after wrapping, every rank holds rank 0's weights, and the
  construction broadcast;
- N ranks, frozen / tied weights: the parameters match one process on the
  whole batch (computed here, without learner code);
- N ranks, collectives and bytes: only all-reduces, one per trainable
  parameter (naive, overlapped) or per bucket (bucketed), issued during
  backward where the rung overlaps, 2Ψ·4·(N-1)/N algorithmic bytes in each step.

In the notebook every input is seeded by the package. Under `distlab grade`
the batches and every rank's different starting weights are drawn from a
secret seed (`inputs`) and each rank receives only its own shard of each batch
and its own starting weights: no rank can compute the full-batch result, or
rank 0's weights, without communicating.

`bucket_layout` looks at `BucketedDDP.__init__` alone: which parameters share
a bucket, in which order, and where each gradient view sits in the flat buffer.
"""
from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch

import distlab
from distlab.checks.draws import draw_seed, drawn_batch_shards, drawn_weights, full_batches, load_weights, weights_of
from distlab.checks.task import Case, Line, Row, check_line, grader, on_one_rank, per_ranks, table, task
from distlab.checks.verdict import compare, expect
from distlab.course.data_parallel.reference import make_model, one_thread, sgd, train_single, trainable
from distlab.meters import track_comm
from distlab.course.models import PRESETS, lm_loss, split_batch, synthetic_batch
from distlab.theory import comm_bytes_per_rank

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist

import distlab
from distlab import add_to_class
from distlab.course.data_parallel.ddp import Bucket"""

# quick mode (tests): 2 steps, the second already reads what the first left; BATCH splits evenly over 2 and 4 ranks
STEPS, BATCH = distlab.pick(quick=2, full=4), 8
BUCKET_MB = 0.02               # several buckets even on the 34k-parameter model
SEED_OFFSET = 100              # rank r builds its first model from seed 100 + r
TOL = dict(atol=1e-5, rtol=1e-4)  # fp32 SGD: summation order only

HANG_HINT = ("Data parallelism hangs when the ranks do not issue the same collectives in the same order: "
             "every rank must all-reduce the same tensors (same sizes), and a bucket must not wait for a "
             "parameter that never gets a gradient (a frozen one).")


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _start_model(variant: str, r: int, inputs: dict | None, prefix: str) -> torch.nn.Module:
    """Rank r's different starting model: seeded by the package in the notebook, drawn under grading."""
    if inputs is None:
        return make_model(variant, seed=SEED_OFFSET + r)
    return load_weights(make_model(variant), inputs, prefix)


def _weights(variant: str, rng: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    return drawn_weights(make_model(variant, seed=draw_seed(rng), device="cpu"), prefix)


def _batch(step: int, r: int, n: int, inputs: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's shard of step `step`'s batch: the package's in the notebook, drawn under grading."""
    if inputs is None:
        return split_batch(synthetic_batch(step, BATCH, PRESETS["tiny"]), r, n)
    dev = distlab.device()
    return inputs[f"x{step}"].to(dev), inputs[f"y{step}"].to(dev)


def _train_on(variant: str, batches: list) -> dict[str, torch.Tensor]:
    """`train_single` on the given full batches (the drawn ones)."""
    with one_thread():
        model = make_model(variant, device="cpu")
        opt = sgd(p for _, p in trainable(model))
        for x, y in batches:
            lm_loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}


# ---- the three rungs, NaiveDDP, OverlappedDDP and BucketedDDP, each trained end to end ------------------
# `cls`: the learner's class name, `kwargs`: what it is built with; `per`: what gets one all-reduce ("trainable
# parameter" or "bucket"); `overlaps`: every all-reduce is launched during backward.

def wrapper_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of each step's batch and, on the broadcast case, its own
    starting weights."""
    out = drawn_batch_shards(rng, case.world_size, STEPS, BATCH)
    if case.args.get("broadcast"):
        for mine in out:
            mine.update(_weights("plain", rng, "start."))
    return out


def wrapper_exercise(case: Case, Wrapper: Any, inputs: dict | None = None, *, cls: str, kwargs: dict) -> dict:
    """On every rank, with the learner's class: the weights after construction, then after training."""
    r, n = distlab.rank(), distlab.world_size()
    out: dict = {}
    if case.args.get("broadcast"):
        distlab.engine.runtime.progress(f"{cls}({n} ranks): the broadcast at construction")
        start = _start_model("plain", r, inputs, "start.")     # every rank starts different ...
        with track_comm() as built:                            # ... until the broadcast, metered
            Wrapper(start, **kwargs)
        out["broadcast"], out["broadcast", "comm"] = _named(start), built.stats()
    for variant in ("frozen", "tied"):
        distlab.engine.runtime.progress(f"{cls}, {n} ranks, {variant} weights: wrapping the model")
        model = make_model(variant)
        ddp = Wrapper(model, **kwargs)
        opt = sgd(p for _, p in trainable(model))
        for step in range(STEPS):
            distlab.engine.runtime.progress(f"{cls}, {n} ranks, {variant} weights, step {step}")
            x, y = _batch(step, r, n, inputs)
            # every step whose parameters are judged is metered, and its traffic judged
            with track_comm() as in_backward:
                lm_loss(ddp, x, y).backward()
            with track_comm() as in_finish:
                ddp.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.setdefault((variant, "comm"), []).append((in_backward.stats(), in_finish.stats()))
        out[variant, "buckets"] = len(getattr(ddp, "buckets", None) or [])
        out[variant] = _named(model)
    return out


def wrapper_reference(case: Case, inputs: list | None = None) -> dict:
    """Here, without learner code: one process on the full batch (the same for every rung)."""
    if inputs is None:
        return _wrapper_reference()
    ref = dict(_wrapper_reference())
    ref.update(on_one_rank(_train_variants, full_batches(inputs, STEPS)))
    if case.args.get("broadcast"):
        ref["broadcast"] = weights_of(inputs[0], "start.")
    return ref


def wrapper_judge(case: Case, outputs: list, reference: dict, *, per: str, overlaps: bool) -> list[Line]:
    n, lines = case.world_size, list(case.lines)
    verdicts = []
    if case.args.get("broadcast"):
        verdicts.append(check_line(lines.pop(0), lambda: _same_as_rank0(outputs, reference["broadcast"], "broadcast")))
    for variant in ("frozen", "tied"):
        verdicts.append(check_line(lines.pop(0), lambda v=variant: _matches(outputs, reference[v], v)))
    verdicts.append(check_line(lines.pop(0), lambda: _wrapper_traffic(outputs, reference, n, per, overlaps)))
    return verdicts


def _wrapper_traffic(outputs: list, reference: dict, n: int, per: str, overlaps: bool, variant: str = "frozen") -> str:
    psi, params = reference[variant, "psi"], reference[variant, "trainable"]
    want = round(comm_bytes_per_rank(psi, n, stage=0, bytes_per_element=4))   # fp32 gradients
    for r, out in enumerate(outputs):
        steps = out[variant, "comm"]
        expect(len(steps) == STEPS, f"rank {r}: {len(steps)} metered steps, expected {STEPS}")
        for step, (in_backward, in_finish) in enumerate(steps):   # every step: its parameters are judged
            at = f"rank {r}" + (f" (step {step})" if step else "")
            calls = {k: in_backward.calls.get(k, 0) + in_finish.calls.get(k, 0)
                     for k in set(in_backward.calls) | set(in_finish.calls)}
            others = {k: v for k, v in calls.items() if k != "all_reduce"}
            expect(not others, f"{at}: unexpected collectives during the step: {others}")
            got = calls.get("all_reduce", 0)
            if per == "bucket":
                buckets = out[variant, "buckets"]
                expect(buckets > 1, f"{at}: expected several buckets of {BUCKET_MB} MiB, found {buckets}")
                expect(got == buckets, f"{at}: {got} all-reduces for {buckets} buckets: one per bucket")
            else:
                expect(got == params, f"{at}: {got} all-reduces, expected one per trainable parameter "
                                      f"({params})")
            if overlaps:
                late = in_finish.calls.get("all_reduce", 0)
                expect(late == 0, f"{at}: {late} of {got} all-reduces started in "
                                  "finish_gradient_synchronization(); launch them from the hooks, during backward")
            sent = in_backward.total_bytes + in_finish.total_bytes
            # Each all-reduce's bytes are rounded on their own: allow one byte per call.
            expect(abs(sent - want) <= got,
                   f"{at}: sent {sent} algorithmic bytes, expected 2*Psi*4*(N-1)/N = {want}")
    when = ", all launched during backward" if overlaps else ""
    return f"one all-reduce per {per}{when}, 2*Psi*4*(N-1)/N bytes"


def wrapper(name: str, answer: str, *, per: str, overlaps: bool, kwargs: dict | None = None) -> Row:
    """One rung's task: on 2 ranks the broadcast at construction, then on 2 and 4 ranks training with frozen and
    with tied weights, and its collectives."""
    c = answer
    return task(name, answer,
                per_ranks((2,), f"{c}: initial broadcast from rank 0", f"{c}, {{n}} ranks, frozen weights",
                          f"{c}, {{n}} ranks, tied weights", f"{c}, {{n}} ranks: collectives and bytes",
                          args={"broadcast": True})
                + per_ranks((4,), f"{c}, {{n}} ranks, frozen weights", f"{c}, {{n}} ranks, tied weights",
                            f"{c}, {{n}} ranks: collectives and bytes"),
                inputs=wrapper_inputs, exercise=partial(wrapper_exercise, cls=c, kwargs=dict(kwargs or {})),
                reference=wrapper_reference, judge=partial(wrapper_judge, per=per, overlaps=overlaps),
                hang_hint=HANG_HINT)


def _train_variants(batches: list) -> dict[str, dict[str, torch.Tensor]]:
    return {variant: _train_on(variant, batches) for variant in ("frozen", "tied")}


@functools.lru_cache(maxsize=1)
def _wrapper_reference() -> dict:
    """What every wrapper task compares with (the same for all three rungs and both world sizes), computed on
    a rank (`on_one_rank`)."""
    return on_one_rank(_wrapper_reference_here)


def _wrapper_reference_here() -> dict:
    ref: dict = {"broadcast": _named(make_model("plain", seed=SEED_OFFSET, device="cpu"))}
    for variant in ("frozen", "tied"):
        ref[variant] = train_single(variant, sgd, steps=STEPS, batch_size=BATCH)
        params = [p for _, p in trainable(make_model(variant, device="cpu"))]
        ref[variant, "trainable"] = len(params)
        ref[variant, "psi"] = sum(p.numel() for p in params)
    return ref


def _same_as_rank0(outputs: list, want: dict, key: Any) -> str:
    """Every rank's weights after construction (`out[key]`) are rank 0's, and the construction's meter
    (`out[key, "comm"]`) counted a broadcast: values and traffic of one execution. Other collectives may come
    with it (PyTorch's DDP all-gathers the parameters' shapes first, a check a learner may copy)."""
    for r, out in enumerate(outputs):
        got = out[key]
        expect(got.keys() == want.keys(), f"rank {r} returned different parameter names")
        for k in want:
            compare(got[k], want[k], atol=0, rtol=0, what=f"rank {r}'s {k}")
    for r, out in enumerate(outputs):
        calls = out[key, "comm"].calls
        expect(calls.get("broadcast", 0) >= 1, f"rank {r}: construction called {calls or 'nothing'}; rank 0's "
               "weights reach every rank by broadcast")
    return "every rank holds rank 0's weights"


def _matches(outputs: list, want: dict, variant: str) -> str:
    for r, out in enumerate(outputs):
        got = out[variant]
        expect(got.keys() == want.keys(), f"rank {r} returned different parameter names")
        for k in want:
            compare(got[k], want[k], what=f"rank {r}'s {k}", **TOL)
    return "matches one process on the full batch"


# ---- bucket_layout ------------------------------------------------------------------------------
# `BucketedDDP.__init__` only: buckets in backward order, closed at the size limit, views in place.


def bucket_layout_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's own starting weights of both models."""
    return [{**_weights("frozen", rng, "frozen."), **_weights("tied", rng, "tied.")}
            for _ in range(case.world_size)]


def bucket_layout_exercise(case: Case, Wrapper: Any, inputs: dict | None = None) -> dict:
    out: dict = {}
    for variant in ("frozen", "tied"):
        distlab.engine.runtime.progress(f"BucketedDDP.__init__, {distlab.world_size()} ranks, {variant} weights")
        model = _start_model(variant, distlab.rank(), inputs, f"{variant}.")
        names = {id(p): k for k, p in model.named_parameters()}
        with track_comm() as built:          # the weights judged come from the calls it counts
            ddp = Wrapper(model, bucket_size_mb=BUCKET_MB)
        out[variant, "comm"] = built.stats()
        out[variant] = {
            "buckets": [[names.get(id(p), "(not a parameter of the model)") for p in b.params]
                        for b in ddp.buckets],
            "flat": [(b.flat.numel(), b.flat.dtype, str(b.flat.device), b.flat.untyped_storage().data_ptr())
                     for b in ddp.buckets],
            "views": [[(v.data_ptr() - b.flat.data_ptr(), tuple(v.shape), v.untyped_storage().data_ptr())
                       for v in b.views] for b in ddp.buckets],
            "param_device": str(next(model.parameters()).device),
            "params": _named(model),
        }
    return out


def bucket_layout_reference(case: Case, inputs: list | None = None) -> dict:
    ref: dict = {}
    limit = BUCKET_MB * 2**20
    for variant in ("frozen", "tied"):
        model = make_model(variant, device="cpu")
        buckets, group, size = [], [], 0
        for k, p in reversed(trainable(model)):
            group.append((k, tuple(p.shape), p.numel()))
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(group)
                group, size = [], 0
        if group:
            buckets.append(group)
        start = (_named(make_model(variant, seed=SEED_OFFSET, device="cpu")) if inputs is None else
                 weights_of(inputs[0], f"{variant}."))
        ref[variant] = {"buckets": buckets, "params": start}
    return ref


def bucket_layout_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    order, views, start = case.lines

    def layout() -> str:
        for variant in ("frozen", "tied"):
            want = [[k for k, _, _ in b] for b in reference[variant]["buckets"]]
            for r, out in enumerate(outputs):
                got = out[variant]["buckets"]
                flat_got, flat_want = [k for b in got for k in b], [k for b in want for k in b]
                expect(sorted(flat_got) == sorted(flat_want),
                       f"{variant} weights, rank {r}: the buckets hold {sorted(set(flat_got) ^ set(flat_want)) or 'duplicates'}"
                       " wrongly: every trainable parameter exactly once, no frozen one")
                expect(flat_got == flat_want, f"{variant} weights, rank {r}: parameters are not in the order "
                                              "backward produces them (reverse of module.parameters())")
                expect(got == want, f"{variant} weights, rank {r}: {len(got)} buckets of "
                                    f"{[len(b) for b in got]} parameters, expected {len(want)} of "
                                    f"{[len(b) for b in want]}: close a bucket once it holds >= {BUCKET_MB} MiB")
        return f"{len(reference['frozen']['buckets'])} and {len(reference['tied']['buckets'])} buckets, " \
               "each trainable parameter once"

    def in_place() -> str:
        # Judged on the learner's own grouping (the layout line judges the grouping itself).
        for variant in ("frozen", "tied"):
            shapes = {k: (shape, m) for b in reference[variant]["buckets"] for k, shape, m in b}
            for r, out in enumerate(outputs):
                o = out[variant]
                expect(len(o["flat"]) == len(o["buckets"]) == len(o["views"]),
                       f"{variant}, rank {r}: {len(o['buckets'])} buckets but {len(o['flat'])} flat buffers")
                for i, (names, (numel, dtype, device, storage)) in enumerate(zip(o["buckets"], o["flat"])):
                    expect(all(k in shapes for k in names), f"{variant}, rank {r}: bucket {i} holds a parameter "
                                                            "that gets no gradient")
                    want = sum(shapes[k][1] for k in names)
                    expect(numel == want, f"{variant}, rank {r}: bucket {i}'s flat buffer has {numel} elements, "
                                          f"its parameters {want}")
                    expect(dtype == torch.float32, f"bucket {i}'s buffer is {dtype}, the gradients are float32")
                    expect(device == o["param_device"], f"bucket {i}'s buffer is on {device}, the parameters "
                                                        f"on {o['param_device']}")
                    expect(len(o["views"][i]) == len(names), f"bucket {i} has {len(o['views'][i])} views for "
                                                             f"{len(names)} parameters")
                    offset = 0
                    for k, (at, vshape, vstorage) in zip(names, o["views"][i]):
                        shape, m = shapes[k]
                        expect(vstorage == storage and at == 4 * offset and vshape == shape,
                               f"{variant}, rank {r}: the view of {k} is not its slice of bucket {i}'s flat "
                               f"buffer (offset {offset}, shape {shape})")
                        offset += m
        return "each gradient's view is its slice of the flat buffer"

    def broadcast() -> str:
        for variant in ("frozen", "tied"):
            _same_as_rank0([{"start": out[variant]["params"], ("start", "comm"): out[variant, "comm"]}
                            for out in outputs], reference[variant]["params"], "start")
        return "every rank holds rank 0's weights"

    return [check_line(order, layout), check_line(views, in_place), check_line(start, broadcast)]


TASKS = table(
    wrapper("naive", "NaiveDDP", per="trainable parameter", overlaps=False),
    wrapper("overlapped", "OverlappedDDP", per="trainable parameter", overlaps=True),
    task("bucket_layout", "BucketedDDP",
         per_ranks((2,), "BucketedDDP.__init__: buckets in backward order, closed at 0.02 MiB",
                   "BucketedDDP.__init__: gradient views inside each bucket's flat buffer",
                   "BucketedDDP.__init__: starts from rank 0's weights"),
         inputs=bucket_layout_inputs, exercise=bucket_layout_exercise, reference=bucket_layout_reference,
         judge=bucket_layout_judge, hang_hint=HANG_HINT),
    wrapper("bucketed", "BucketedDDP", per="bucket", overlaps=True, kwargs={"bucket_size_mb": BUCKET_MB}),
)

grade = grader(TASKS)
