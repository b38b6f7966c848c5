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
from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.ch07_cp import UlyssesTask, ZigzagTask
from distlab.checks.ch07_sp import SPBlockTask, SPOpsTask
from distlab.checks.task import Case, Line, Task, grader, check_line
from distlab.checks.verdict import CheckFailed, expect
from distlab.meters import track_comm
from distlab.course.tensor_parallel.model import build_tp_model

from distlab.checks.ch07_common import (  # noqa: F401 - PRELUDE and the constants are part of this module's API
    ATOL, B, CFG, COL, E, HANG_HINT, PRELUDE, ROW, RTOL, STEPS, TRAIN_ATOL, TRAIN_RTOL, all_reduce_of, block,
    comm_of, expect_traffic, half_of, make_optimizer, metered_pair, randn, same, shard_of, values_line)


# ---- Task 1: f and g --------------------------------------------------------------------------------

class FG(Task):
    name, answers, hang_hint = "f_g", ("CopyToTP", "ReduceFromTP"), HANG_HINT

    def cases(self) -> list[Case]:
        out = [Case(n, (f"f_g, {n} ranks, values", f"f_g, {n} ranks, traffic"), {"groups": 1}) for n in (2, 4)]
        out.append(Case(4, ("f_g, 4 ranks in 2 groups, values", "f_g, 4 ranks in 2 groups, traffic"), {"groups": 2}))
        return out

    # Each rank's four tensors: f's input and output gradient, g's input and output gradient.
    KEYS = ("f_x", "f_dy", "g_x", "g_dz")

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Under grading: every rank's four tensors, drawn; in the notebook `_fixed`'s seeded ones."""
        shape = (B, CFG.seq_len, CFG.d_model)
        return [{k: torch.randn(*shape, generator=rng) for k in self.KEYS} for _ in range(case.world_size)]

    def _fixed(self, r: int) -> dict[str, torch.Tensor]:
        shape = (B, CFG.seq_len, CFG.d_model)
        return {k: randn(*shape, seed=100 * i + r) for i, k in enumerate(self.KEYS)}

    def exercise(self, case: Case, f: Any, g: Any, inputs: dict | None = None) -> dict:
        r, n = distlab.rank(), distlab.world_size()
        mine = self._fixed(r) if inputs is None else inputs
        group = None
        if case.args["groups"] > 1:
            size = n // case.args["groups"]
            groups = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)]
            group = groups[r // size]
        return {"f": metered_pair(f, mine["f_x"], mine["f_dy"], group, "f (CopyToTP)"),
                "g": metered_pair(g, mine["g_x"], mine["g_dz"], group, "g (ReduceFromTP)")}

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        n = case.world_size
        size = n // case.args["groups"]
        given = [self._fixed(r) for r in range(n)] if inputs is None else inputs
        ref = {}
        for r in range(n):
            mates = range(r // size * size, r // size * size + size)
            ref[r] = {"f_out": given[r]["f_x"],
                      "f_grad": sum(given[m]["f_dy"] for m in mates),
                      "g_out": sum(given[m]["g_x"] for m in mates),
                      "g_grad": given[r]["g_dz"]}
        return {"ranks": ref, "size": size}

    def judge(self, case: Case, outputs: list, ref: dict) -> list[Line]:
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

class LayerTask(Task):
    """Build the learner's layer from a reference layer on every rank; one forward and backward.

    Subclasses give `make(answer, ref_layer)`, what rank r feeds in and the gradient it puts on the output
    (`feed_dim`, `grad_dim`: the dimension its slice of each is cut along, None: the whole), what its outputs
    should be, and the traffic. Every rank holds the whole layer (by design); under grading the input and the
    output gradient are drawn (`inputs`) and rank r receives only its slice of each."""

    hang_hint = HANG_HINT
    lines_of = ("shards", "values", "traffic")
    prefix = ""          # the reference layer's name in its block: decides how a parameter is split
    feed_dim: int | None = None      # rank r's part of the input: chunk r along this dimension (None: all of it)
    grad_dim: int | None = None      # the same for the gradient put on the output

    def __init__(self, name: str, answer: str, words: str) -> None:
        self.name, self.answers, self.words = name, (answer,), words

    def cases(self) -> list[Case]:
        return [Case(n, tuple(f"{self.name}, {n} ranks, {k}" for k in self.lines_of)) for n in (2, 4)]

    # subclass hooks -----------------------------------------------------------------------------
    def ref_layer(self) -> torch.nn.Module:
        raise NotImplementedError

    def make(self, answer: Any, layer: torch.nn.Module) -> torch.nn.Module:
        return answer(layer)

    def feed(self, x: torch.Tensor, r: int, t: int) -> torch.Tensor:
        """What rank r gets of the full input."""
        return x if self.feed_dim is None else x.chunk(t, self.feed_dim)[r].clone()

    def grad_out(self, g: torch.Tensor, r: int, t: int) -> torch.Tensor:
        """What rank r gets of the full output gradient."""
        return g if self.grad_dim is None else g.chunk(t, self.grad_dim)[r].clone()

    def out_of(self, y: torch.Tensor, r: int, t: int) -> torch.Tensor:
        return y                                     # what rank r's output should be, of the full one

    def in_grad_of(self, ref: dict, r: int, t: int) -> torch.Tensor:
        return ref["x_grad"]

    def traffic(self, t: int) -> tuple[dict, dict]:
        raise NotImplementedError

    def in_features(self) -> int:
        return CFG.d_model

    def out_features(self) -> int:
        return CFG.d_model

    # the task ------------------------------------------------------------------------------------
    def _full(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        layer = self.ref_layer()
        x = randn(B, CFG.seq_len, self.in_features(), seed=7)
        g = randn(B, CFG.seq_len, self.out_features(), seed=8)
        return layer, x, g

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
        """Under grading: the input and the output gradient drawn; rank r receives only its part of each."""
        t = case.world_size
        x = torch.randn(B, CFG.seq_len, self.in_features(), generator=rng)
        g = torch.randn(B, CFG.seq_len, self.out_features(), generator=rng)
        return [{"x": self.feed(x, r, t), "g": self.grad_out(g, r, t)} for r in range(t)]

    def exercise(self, case: Case, answer: Any, inputs: dict | None = None) -> dict:
        r, t, dev = distlab.rank(), distlab.world_size(), distlab.device()
        layer, x, g = self._full()
        distlab.engine.runtime.progress(f"{self.name}: building from the full layer ({t} ranks)")
        mine = self.make(answer, layer.to(dev))
        xin = (self.feed(x, r, t) if inputs is None else inputs["x"]).to(dev).requires_grad_()
        distlab.engine.runtime.progress(f"{self.name}: forward")
        with track_comm() as fwd:
            y = mine(xin)
        distlab.engine.runtime.progress(f"{self.name}: backward")
        with track_comm() as bwd:
            y.backward((self.grad_out(g, r, t) if inputs is None else inputs["g"]).to(dev))
        return {"out": y.detach(), "x_grad": xin.grad,
                "params": {k: p.detach() for k, p in mine.named_parameters()},
                "grads": {k: p.grad for k, p in mine.named_parameters()},
                "fwd": fwd.stats(), "bwd": bwd.stats()}

    def reference(self, case: Case, inputs: list | None = None) -> dict:
        layer, x, g = self._full()
        if inputs is not None:      # the drawn ones, put back together from the ranks' parts
            x, g = (inputs[0][k] if dim is None else torch.cat([i[k] for i in inputs], dim)
                    for k, dim in (("x", self.feed_dim), ("g", self.grad_dim)))
        x = x.clone().requires_grad_()
        y = layer(x)
        y.backward(g)
        return {"out": y.detach(), "x_grad": x.grad, "g": g,
                "params": {k: p.detach() for k, p in layer.named_parameters()},
                "grads": {k: p.grad for k, p in layer.named_parameters()}}

    def judge(self, case: Case, outputs: list, ref: dict) -> list[Line]:
        t = case.world_size

        def shards() -> str:
            def check(r: int, out: dict) -> None:
                names, want = set(out["params"]), set(ref["params"])
                expect(names == want, f"parameters {sorted(names)}; expected the names {sorted(want)}")
                for k in sorted(want):
                    same(out["params"][k], shard_of(self.prefix + k, ref["params"][k], r, t), f"parameter {k}", 0, 0)
            values_line(outputs, check)
            return f"each rank holds its 1/{t} of every split weight"

        def values() -> str:
            def check(r: int, out: dict) -> None:
                same(out["out"], self.out_of(ref["out"], r, t), "the output")
                same(out["x_grad"], self.in_grad_of(ref, r, t), "the input gradient")
                for k in sorted(ref["grads"]):
                    same(out["grads"].get(k), shard_of(self.prefix + k, ref["grads"][k], r, t), f"the gradient of {k}")
            return values_line(outputs, check)

        def traffic() -> str:
            fwd, bwd = self.traffic(t)
            for r, out in enumerate(outputs):
                expect_traffic(f"rank {r}, forward", out["fwd"], fwd)
                expect_traffic(f"rank {r}, backward", out["bwd"], bwd)
            return self.words

        return [check_line(case.lines[0], shards), check_line(case.lines[1], values), check_line(case.lines[2], traffic)]


class ColumnTask(LayerTask):
    prefix = "fc."

    def ref_layer(self) -> torch.nn.Module:
        return block(1).mlp.fc                   # h -> 4h

    grad_dim = -1                                # rank r gets the gradient of its columns of the output

    def out_features(self) -> int:
        return CFG.d_ff

    def out_of(self, y: torch.Tensor, r: int, t: int) -> torch.Tensor:
        return y.chunk(t, -1)[r]

    def in_grad_of(self, ref: dict, r: int, t: int) -> torch.Tensor:
        # No f inside: rank r's input gradient is its own part, g_r @ W_r.
        return ref["g"].chunk(t, -1)[r] @ ref["params"]["weight"].chunk(t, 0)[r]

    def traffic(self, t: int) -> tuple[dict, dict]:
        return {}, {}


class RowTask(LayerTask):
    prefix = "out."

    def ref_layer(self) -> torch.nn.Module:
        return block(2).mlp.out                  # 4h -> h

    feed_dim = -1                                # rank r gets its columns of the input

    def in_features(self) -> int:
        return CFG.d_ff

    def in_grad_of(self, ref: dict, r: int, t: int) -> torch.Tensor:
        return ref["x_grad"].chunk(t, -1)[r]

    def traffic(self, t: int) -> tuple[dict, dict]:
        return {"all_reduce": all_reduce_of(B * CFG.seq_len * CFG.d_model, t)}, {}


class BlockPartTask(LayerTask):
    """The MLP or the attention: f at the entry, g at the exit."""

    def __init__(self, name: str, answer: str, words: str, part: str) -> None:
        super().__init__(name, answer, words)
        self.part = part

    def ref_layer(self) -> torch.nn.Module:
        return getattr(block(3), self.part)

    def traffic(self, t: int) -> tuple[dict, dict]:
        one = {"all_reduce": all_reduce_of(B * CFG.seq_len * CFG.d_model, t)}
        return one, one


# ---- Task 6: the whole model, trained ------------------------------------------------------------

class TrainTask(Task):
    name, answers, hang_hint = "train", ("tensor_parallel",), HANG_HINT
    LAYERS = 2

    def cases(self) -> list[Case]:
        return [Case(n, (f"train, {n} ranks, losses and parameters", f"train, {n} ranks, traffic per step"))
                for n in (2, 4)]

    def _model(self, device: Any) -> torch.nn.Module:
        return build_tp_model(CFG, seed=4, device=device, n_layers=self.LAYERS)

    def _steps(self, model: torch.nn.Module, meter: bool) -> tuple[list[float], list]:
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

    def exercise(self, case: Case, tensor_parallel: Any) -> dict:
        model = tensor_parallel(self._model(distlab.device()))
        losses, stats = self._steps(model, True)
        return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}, "comm": stats}

    def reference(self, case: Case) -> dict:
        model = self._model("cpu")
        losses, _ = self._steps(model, False)
        return {"losses": losses, "params": {k: p.detach() for k, p in model.named_parameters()}}

    def judge(self, case: Case, outputs: list, ref: dict) -> list[Line]:
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
            calls = 4 * self.LAYERS
            total = round(self.LAYERS * tp_block_bytes(B * CFG.seq_len, CFG.d_model, t, bytes_per_element=E))
            for r, out in enumerate(outputs):
                expect(len(out["comm"]) == STEPS, f"rank {r}: {len(out['comm'])} metered steps, expected {STEPS}")
                for step, stats in enumerate(out["comm"]):
                    expect_traffic(f"rank {r}, " + (f"step {step}" if step else "one step"), stats,
                                   {"all_reduce": (calls, total)})
            return f"{calls} all-reduces of B x S x h per step: 2 forward + 2 backward per block"

        return [check_line(case.lines[0], values), check_line(case.lines[1], traffic)]



TASKS: dict[str, Task] = {t.name: t for t in (
    FG(),
    ColumnTask("column", "ColumnParallelLinear", "no communication: the caller's f and g do it"),
    RowTask("row", "RowParallelLinear", "one all-reduce forward (g), none backward"),
    BlockPartTask("mlp", "TensorParallelMLP", "one all-reduce of B x S x h forward, one backward", "mlp"),
    BlockPartTask("attention", "TensorParallelAttention", "one all-reduce of B x S x h forward, one backward",
                  "attn"),
    TrainTask(),
    SPOpsTask(),
    SPBlockTask(),
    ZigzagTask(),
    UlyssesTask(),
)}

grade = grader(TASKS)
