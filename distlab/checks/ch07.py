"""Lab 7's graded tasks: Megatron's f and g, column- and row-parallel linears, a tensor-parallel MLP,
attention and model, the sequence-parallel variant (`ch07_sp`), and context parallelism: zig-zag ring
attention and Ulysses (`ch07_cp`).

Every task runs the learner's classes on 2 and 4 real ranks (the f/g task also on 4 ranks split
into two groups of 2) on chapter 7's model (`distlab.course.tensor_parallel.model`, preset 'tp-tiny': h = 32, 8 heads,
S = 16) and judges, from raw outputs, against one process computing the same thing here:

- values: forward outputs, input gradients and parameter gradients, slice by slice (rank r owns
  rows r of a column-parallel weight, columns r of a row-parallel one, and the sequence slice r
  under SP); after a few SGD steps, every parameter;
- shards: a rank holds 1/t of every split weight, not a full copy it slices on the fly;
- traffic: which collectives ran in forward and in backward, and their algorithmic bytes, against
  `distlab.theory.tensor_parallel` (for example one all-reduce of B x S x h per MLP forward and one backward).

Under `distlab grade` the tensors fed in and the gradients put on the outputs (f/g, the layers, the SP ops and
block, context parallelism) are drawn from a secret seed, each rank receiving only its part: no rank can rebuild
another's from the package's seeds. The layers' weights stay the package's (every rank is handed the whole layer).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

import distlab
from distlab.checks.ch07_cp import (ulysses_exercise, ulysses_inputs, ulysses_judge, ulysses_reference, zigzag_exercise,
                                    zigzag_inputs, zigzag_judge, zigzag_reference)
from distlab.checks.ch07_sp import (sp_block_exercise, sp_block_inputs, sp_block_judge, sp_block_reference,
                                    sp_ops_exercise, sp_ops_inputs, sp_ops_judge, sp_ops_reference)
from distlab.checks.task import Case, Line, Row, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import expect
from distlab.meters import track_comm
from distlab.course.tensor_parallel.model import build_tp_model

from distlab.checks.ch07_common import (  # noqa: F401 - PRELUDE and the constants are part of this module's API
    ATOL, B, CFG, COL, E, HANG_HINT, PRELUDE, ROW, RTOL, STEPS, TRAIN_ATOL, TRAIN_RTOL, all_reduce_of, block,
    comm_of, expect_traffic, half_of, make_optimizer, metered_pair, randn, same, shard_of, values_line)


# ---- Task 1: f and g --------------------------------------------------------------------------------

# Each rank's four tensors: f's input and output gradient, g's input and output gradient.
F_G_KEYS = ("f_x", "f_dy", "g_x", "g_dz")


def f_g_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's four tensors, drawn; in the notebook `_fixed`'s seeded ones."""
    shape = (B, CFG.seq_len, CFG.d_model)
    return [{k: torch.randn(*shape, generator=rng) for k in F_G_KEYS} for _ in range(case.world_size)]


def _f_g_fixed(r: int) -> dict[str, torch.Tensor]:
    shape = (B, CFG.seq_len, CFG.d_model)
    return {k: randn(*shape, seed=100 * i + r) for i, k in enumerate(F_G_KEYS)}


def f_g_exercise(case: Case, f: Any, g: Any, inputs: dict | None = None) -> dict:
    r, n = distlab.rank(), distlab.world_size()
    mine = _f_g_fixed(r) if inputs is None else inputs
    group = None
    if case.args["groups"] > 1:
        size = n // case.args["groups"]
        groups = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)]
        group = groups[r // size]
    return {"f": metered_pair(f, mine["f_x"], mine["f_dy"], group, "f (CopyToTP)"),
            "g": metered_pair(g, mine["g_x"], mine["g_dz"], group, "g (ReduceFromTP)")}


def f_g_reference(case: Case, inputs: list | None = None) -> dict:
    n = case.world_size
    size = n // case.args["groups"]
    given = [_f_g_fixed(r) for r in range(n)] if inputs is None else inputs
    ref = {}
    for r in range(n):
        mates = range(r // size * size, r // size * size + size)
        ref[r] = {"f_out": given[r]["f_x"],
                  "f_grad": sum(given[m]["f_dy"] for m in mates),
                  "g_out": sum(given[m]["g_x"] for m in mates),
                  "g_grad": given[r]["g_dz"]}
    return {"ranks": ref, "size": size}


def f_g_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    t, numel = ref["size"], B * CFG.seq_len * CFG.d_model

    def values() -> str:
        def check(r: int, out: dict) -> None:
            want = ref["ranks"][r]
            same(out["f"]["out"], want["f_out"], "f's output (must be its input)")
            same(out["f"]["grad"], want["f_grad"], "f's input gradient (the sum over the group)")
            same(out["g"]["out"], want["g_out"], "g's output (the sum over the group)")
            same(out["g"]["grad"], want["g_grad"], "g's input gradient (must be the output gradient)")
        return values_line(outputs, check)

    def traffic() -> str:
        for r, out in enumerate(outputs):
            expect_traffic(f"rank {r}, f forward", out["f"]["fwd"], {})
            expect_traffic(f"rank {r}, f backward", out["f"]["bwd"], {"all_reduce": all_reduce_of(numel, t)})
            expect_traffic(f"rank {r}, g forward", out["g"]["fwd"], {"all_reduce": all_reduce_of(numel, t)})
            expect_traffic(f"rank {r}, g backward", out["g"]["bwd"], {})
        return "f: nothing forward, one all-reduce backward; g: the reverse"

    return [check_line(case.lines[0], values), check_line(case.lines[1], traffic)]


# ---- Tasks 2-5: one layer at a time -----------------------------------------------------------------
# Build the learner's layer from a reference layer on every rank; one forward and backward. A `Layer` says
# what differs between the four: the reference layer, what rank r feeds in and the gradient it puts on the
# output (`feed_dim`, `grad_dim`: the dimension its slice of each is cut along, None: the whole), what its
# outputs should be, and the traffic. Every rank holds the whole layer (by design); under grading the input
# and the output gradient are drawn (`layer_inputs`) and rank r receives only its slice of each.

def _whole(y: torch.Tensor, r: int, t: int) -> torch.Tensor:
    return y                                     # what rank r's output should be, of the full one


def _whole_x_grad(ref: dict, r: int, t: int) -> torch.Tensor:
    return ref["x_grad"]


@dataclass(frozen=True)
class Layer:
    ref_layer: Callable[[], torch.nn.Module]
    traffic: Callable[[int], tuple[dict, dict]]  # forward's and backward's expected collectives on t ranks
    prefix: str = ""             # the reference layer's name in its block: decides how a parameter is split
    feed_dim: int | None = None  # rank r's part of the input: chunk r along this dimension (None: all of it)
    grad_dim: int | None = None  # the same for the gradient put on the output
    in_features: int = CFG.d_model
    out_features: int = CFG.d_model
    out_of: Callable[[torch.Tensor, int, int], torch.Tensor] = _whole
    in_grad_of: Callable[[dict, int, int], torch.Tensor] = _whole_x_grad

    def feed(self, x: torch.Tensor, r: int, t: int) -> torch.Tensor:
        """What rank r gets of the full input."""
        return x if self.feed_dim is None else x.chunk(t, self.feed_dim)[r].clone()

    def grad_out(self, g: torch.Tensor, r: int, t: int) -> torch.Tensor:
        """What rank r gets of the full output gradient."""
        return g if self.grad_dim is None else g.chunk(t, self.grad_dim)[r].clone()

    def full(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        layer = self.ref_layer()
        x = randn(B, CFG.seq_len, self.in_features, seed=7)
        g = randn(B, CFG.seq_len, self.out_features, seed=8)
        return layer, x, g


def layer_inputs(layer: Layer, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: the input and the output gradient drawn; rank r receives only its part of each."""
    t = case.world_size
    x = torch.randn(B, CFG.seq_len, layer.in_features, generator=rng)
    g = torch.randn(B, CFG.seq_len, layer.out_features, generator=rng)
    return [{"x": layer.feed(x, r, t), "g": layer.grad_out(g, r, t)} for r in range(t)]


def layer_exercise(name: str, layer: Layer, case: Case, answer: Any, inputs: dict | None = None) -> dict:
    r, t, dev = distlab.rank(), distlab.world_size(), distlab.device()
    full, x, g = layer.full()
    distlab.engine.runtime.progress(f"{name}: building from the full layer ({t} ranks)")
    mine = answer(full.to(dev))
    xin = (layer.feed(x, r, t) if inputs is None else inputs["x"]).to(dev).requires_grad_()
    distlab.engine.runtime.progress(f"{name}: forward")
    with track_comm() as fwd:
        y = mine(xin)
    distlab.engine.runtime.progress(f"{name}: backward")
    with track_comm() as bwd:
        y.backward((layer.grad_out(g, r, t) if inputs is None else inputs["g"]).to(dev))
    return {"out": y.detach(), "x_grad": xin.grad,
            "params": {k: p.detach() for k, p in mine.named_parameters()},
            "grads": {k: p.grad for k, p in mine.named_parameters()},
            "fwd": fwd.stats(), "bwd": bwd.stats()}


def layer_reference(layer: Layer, case: Case, inputs: list | None = None) -> dict:
    full, x, g = layer.full()
    if inputs is not None:      # the drawn ones, put back together from the ranks' parts
        x, g = (inputs[0][k] if dim is None else torch.cat([i[k] for i in inputs], dim)
                for k, dim in (("x", layer.feed_dim), ("g", layer.grad_dim)))
    x = x.clone().requires_grad_()
    y = full(x)
    y.backward(g)
    return {"out": y.detach(), "x_grad": x.grad, "g": g,
            "params": {k: p.detach() for k, p in full.named_parameters()},
            "grads": {k: p.grad for k, p in full.named_parameters()}}


def layer_judge(layer: Layer, words: str, case: Case, outputs: list, ref: dict) -> list[Line]:
    t = case.world_size

    def shards() -> str:
        def check(r: int, out: dict) -> None:
            names, want = set(out["params"]), set(ref["params"])
            expect(names == want, f"parameters {sorted(names)}; expected the names {sorted(want)}")
            for k in sorted(want):
                same(out["params"][k], shard_of(layer.prefix + k, ref["params"][k], r, t), f"parameter {k}", 0, 0)
        values_line(outputs, check)
        return f"each rank holds its 1/{t} of every split weight"

    def values() -> str:
        def check(r: int, out: dict) -> None:
            same(out["out"], layer.out_of(ref["out"], r, t), "the output")
            same(out["x_grad"], layer.in_grad_of(ref, r, t), "the input gradient")
            for k in sorted(ref["grads"]):
                same(out["grads"].get(k), shard_of(layer.prefix + k, ref["grads"][k], r, t), f"the gradient of {k}")
        return values_line(outputs, check)

    def traffic() -> str:
        fwd, bwd = layer.traffic(t)
        for r, out in enumerate(outputs):
            expect_traffic(f"rank {r}, forward", out["fwd"], fwd)
            expect_traffic(f"rank {r}, backward", out["bwd"], bwd)
        return words

    return [check_line(case.lines[0], shards), check_line(case.lines[1], values), check_line(case.lines[2], traffic)]


def layer_task(name: str, answer: str, words: str, layer: Layer) -> Row:
    """One layer's task on 2 and 4 ranks: its shards, its values, its traffic (said as `words`)."""
    return task(name, answer, per_ranks((2, 4), *(f"{name}, {{n}} ranks, {k}" for k in ("shards", "values", "traffic"))),
                inputs=partial(layer_inputs, layer), exercise=partial(layer_exercise, name, layer),
                reference=partial(layer_reference, layer), judge=partial(layer_judge, layer, words),
                hang_hint=HANG_HINT)


# Column: h -> 4h; rank r gets the gradient of its columns of the output. No f inside: rank r's input
# gradient is its own part, g_r @ W_r.
def _fc() -> torch.nn.Module:
    return block(1).mlp.fc


def _columns_of_output(y: torch.Tensor, r: int, t: int) -> torch.Tensor:
    return y.chunk(t, -1)[r]


def _column_x_grad(ref: dict, r: int, t: int) -> torch.Tensor:
    return ref["g"].chunk(t, -1)[r] @ ref["params"]["weight"].chunk(t, 0)[r]


def _no_traffic(t: int) -> tuple[dict, dict]:
    return {}, {}


COLUMN = Layer(_fc, _no_traffic, prefix="fc.", grad_dim=-1, out_features=CFG.d_ff, out_of=_columns_of_output,
               in_grad_of=_column_x_grad)


# Row: 4h -> h; rank r gets its columns of the input.
def _out() -> torch.nn.Module:
    return block(2).mlp.out


def _row_x_grad(ref: dict, r: int, t: int) -> torch.Tensor:
    return ref["x_grad"].chunk(t, -1)[r]


def _g_forward(t: int) -> tuple[dict, dict]:
    return {"all_reduce": all_reduce_of(B * CFG.seq_len * CFG.d_model, t)}, {}


ROW = Layer(_out, _g_forward, prefix="out.", feed_dim=-1, in_features=CFG.d_ff, in_grad_of=_row_x_grad)


# The MLP or the attention: f at the entry, g at the exit.
def _block_part(part: str) -> torch.nn.Module:
    return getattr(block(3), part)


def _f_and_g(t: int) -> tuple[dict, dict]:
    one = {"all_reduce": all_reduce_of(B * CFG.seq_len * CFG.d_model, t)}
    return one, one


MLP = Layer(partial(_block_part, "mlp"), _f_and_g)
ATTENTION = Layer(partial(_block_part, "attn"), _f_and_g)


# ---- Task 6: the whole model, trained ------------------------------------------------------------

TRAIN_LAYERS = 2


def _train_model(device: Any) -> torch.nn.Module:
    return build_tp_model(CFG, seed=4, device=device, n_layers=TRAIN_LAYERS)


def _train_steps(model: torch.nn.Module, meter: bool) -> tuple[list[float], list]:
    """`meter`: each step's forward and backward metered (every step: the parameters after all of them are
    judged); the traffic of each, in order."""
    from distlab.course.models import lm_loss, synthetic_batch
    opt = make_optimizer(model.parameters())
    losses, stats = [], []
    for step in range(STEPS):
        distlab.engine.runtime.progress(f"train: step {step}")
        x, y = synthetic_batch(step, B, CFG, device=next(model.parameters()).device)
        with track_comm() if meter else contextlib.nullcontext() as m:
            loss = lm_loss(model, x, y)
            loss.backward()
        if m is not None:
            stats.append(m.stats())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, stats


def train_exercise(case: Case, tensor_parallel: Any) -> dict:
    model = tensor_parallel(_train_model(distlab.device()))
    losses, stats = _train_steps(model, True)
    return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}, "comm": stats}


def train_reference(case: Case) -> dict:
    model = _train_model("cpu")
    losses, _ = _train_steps(model, False)
    return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}}


def train_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    t = case.world_size

    def values() -> str:
        def check(r: int, out: dict) -> None:
            same(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), "the losses", TRAIN_ATOL, TRAIN_RTOL)
            names, want = set(out["params"]), set(ref["params"])
            expect(names == want, f"parameters {sorted(names - want)[:4]} are not the model's "
                                  f"(keep the names: blocks.0.attn.wq.weight, ...); missing {sorted(want - names)[:4]}")
            for k in sorted(want):
                same(out["params"][k], shard_of(k, ref["params"][k], r, t), f"{k} after {STEPS} steps",
                     TRAIN_ATOL, TRAIN_RTOL)
        values_line(outputs, check)
        return f"{STEPS} SGD steps match one process, each rank holding its 1/{t}"

    def traffic() -> str:
        from distlab.theory.tensor_parallel import tp_block_bytes
        calls = 4 * TRAIN_LAYERS
        total = round(TRAIN_LAYERS * tp_block_bytes(B * CFG.seq_len, CFG.d_model, t, bytes_per_element=E))
        for r, out in enumerate(outputs):
            expect(len(out["comm"]) == STEPS, f"rank {r}: {len(out['comm'])} metered steps, expected {STEPS}")
            for step, stats in enumerate(out["comm"]):
                expect_traffic(f"rank {r}, " + (f"step {step}" if step else "one step"), stats,
                               {"all_reduce": (calls, total)})
        return f"{calls} all-reduces of B x S x h per step: 2 forward + 2 backward per block"

    return [check_line(case.lines[0], values), check_line(case.lines[1], traffic)]


TASKS = table(
    task("f_g", ("CopyToTP", "ReduceFromTP"),
         per_ranks((2, 4), "f_g, {n} ranks, values", "f_g, {n} ranks, traffic", args={"groups": 1})
         + per_ranks((4,), "f_g, {n} ranks in 2 groups, values", "f_g, {n} ranks in 2 groups, traffic",
                     args={"groups": 2}),
         inputs=f_g_inputs, exercise=f_g_exercise, reference=f_g_reference, judge=f_g_judge, hang_hint=HANG_HINT),
    layer_task("column", "ColumnParallelLinear", "no communication: the caller's f and g do it", COLUMN),
    layer_task("row", "RowParallelLinear", "one all-reduce forward (g), none backward", ROW),
    layer_task("mlp", "TensorParallelMLP", "one all-reduce of B x S x h forward, one backward", MLP),
    layer_task("attention", "TensorParallelAttention", "one all-reduce of B x S x h forward, one backward", ATTENTION),
    task("train", "tensor_parallel",
         per_ranks((2, 4), "train, {n} ranks, losses and parameters", "train, {n} ranks, traffic per step"),
         exercise=train_exercise, reference=train_reference, judge=train_judge, hang_hint=HANG_HINT),
    task("sp_ops", ("GatherFromSP", "ReduceScatterToSP"),
         per_ranks((2, 4), "sp_ops, {n} ranks, values", "sp_ops, {n} ranks, traffic"),
         inputs=sp_ops_inputs, exercise=sp_ops_exercise, reference=sp_ops_reference, judge=sp_ops_judge,
         hang_hint=HANG_HINT),
    task("sp_block", "SequenceParallelBlock",
         per_ranks((2, 4), "sp_block, {n} ranks, values", "sp_block, {n} ranks, training", "sp_block, {n} ranks, traffic"),
         inputs=sp_block_inputs, exercise=sp_block_exercise, reference=sp_block_reference, judge=sp_block_judge,
         hang_hint=HANG_HINT),
    task("zigzag", "zigzag_ring_attention",
         per_ranks((2, 4), "zigzag, {n} ranks, values", "zigzag, {n} ranks, traffic", "zigzag, {n} ranks, balance"),
         inputs=zigzag_inputs, exercise=zigzag_exercise, reference=zigzag_reference, judge=zigzag_judge,
         hang_hint=HANG_HINT),
    task("ulysses", ("seq_to_heads", "heads_to_seq"),
         per_ranks((2, 4), "ulysses, {n} ranks, layouts", "ulysses, {n} ranks, attention", "ulysses, {n} ranks, traffic"),
         inputs=ulysses_inputs, exercise=ulysses_exercise, reference=ulysses_reference, judge=ulysses_judge,
         hang_hint=HANG_HINT),
)

grade = grader(TASKS)
