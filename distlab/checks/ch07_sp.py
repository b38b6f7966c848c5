"""Lab 7's sequence-parallel tasks (`distlab.checks.ch07` lists them): the two SP operators, and a block
whose LayerNorms and residual stream hold 1/t of the sequence on each rank."""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.ch07_common import (ATOL, B, CFG, STEPS, TRAIN_ATOL, TRAIN_RTOL, all_reduce_of, block,
                                        expect_traffic, half_of, make_optimizer, metered_pair, randn, same, shard_of,
                                        values_line)
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import CheckFailed, expect
from distlab.meters import track_comm

SHAPE = (B, CFG.seq_len, CFG.d_model)


SP_OPS_KEYS = ("g_x", "g_dy", "s_x", "s_dz")

SP_OPS_SLICED = ("g_x", "s_dz")


def sp_ops_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's four tensors, drawn (the sequence slices: only this rank's slice)."""
    t = case.world_size
    return [{k: torch.randn(*SHAPE, generator=rng).chunk(t, 1)[r].contiguous() if k in SP_OPS_SLICED
             else torch.randn(*SHAPE, generator=rng) for k in SP_OPS_KEYS} for r in range(t)]


def _sp_ops_fixed(r: int, t: int) -> dict[str, torch.Tensor]:
    return {k: randn(*SHAPE, seed=100 * i + r).chunk(t, 1)[r].contiguous() if k in SP_OPS_SLICED
            else randn(*SHAPE, seed=100 * i + r) for i, k in enumerate(SP_OPS_KEYS)}


def sp_ops_exercise(case: Case, gather: Any, scatter: Any, inputs: dict | None = None) -> dict:
    r, t = distlab.rank(), distlab.world_size()
    mine = _sp_ops_fixed(r, t) if inputs is None else inputs
    return {"gather": metered_pair(gather, mine["g_x"], mine["g_dy"], None, "GatherFromSP"),
            "scatter": metered_pair(scatter, mine["s_x"], mine["s_dz"], None, "ReduceScatterToSP")}


def sp_ops_reference(case: Case, inputs: list | None = None) -> dict:
    t = case.world_size
    given = [_sp_ops_fixed(m, t) for m in range(t)] if inputs is None else inputs
    shards = [given[m]["g_x"] for m in range(t)]
    gsum = sum(given[m]["g_dy"] for m in range(t))
    xsum = sum(given[m]["s_x"] for m in range(t))
    hs = [given[m]["s_dz"] for m in range(t)]
    return {r: {"gather_out": torch.cat(shards, 1), "gather_grad": gsum.chunk(t, 1)[r],
                "scatter_out": xsum.chunk(t, 1)[r], "scatter_grad": torch.cat(hs, 1)} for r in range(t)}


def sp_ops_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    t, numel = case.world_size, B * CFG.seq_len * CFG.d_model

    def values() -> str:
        def check(r: int, out: dict) -> None:
            want = ref[r]
            same(out["gather"]["out"], want["gather_out"], "GatherFromSP's output (the whole sequence)")
            same(out["gather"]["grad"], want["gather_grad"],
                 "GatherFromSP's input gradient (my slice of the sum over ranks)")
            same(out["scatter"]["out"], want["scatter_out"], "ReduceScatterToSP's output (my slice of the sum)")
            same(out["scatter"]["grad"], want["scatter_grad"],
                 "ReduceScatterToSP's input gradient (every rank's slice, gathered)")
        return values_line(outputs, check)

    def traffic() -> str:
        for r, out in enumerate(outputs):
            expect_traffic(f"rank {r}, gather forward", out["gather"]["fwd"], {"all_gather": half_of(numel, t)})
            expect_traffic(f"rank {r}, gather backward", out["gather"]["bwd"], {"reduce_scatter": half_of(numel, t)})
            expect_traffic(f"rank {r}, reduce-scatter forward", out["scatter"]["fwd"],
                           {"reduce_scatter": half_of(numel, t)})
            expect_traffic(f"rank {r}, reduce-scatter backward", out["scatter"]["bwd"],
                           {"all_gather": half_of(numel, t)})
        return "all-gather <-> reduce-scatter, (t-1)/t x B S h each: half an all-reduce"

    return [check_line(case.lines[0], values), check_line(case.lines[1], traffic)]


def _sp_block_batch(step: int, r: int | None, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, target = randn(*SHAPE, seed=10 + step), randn(*SHAPE, seed=20 + step)
    if r is None:
        return x, target
    return x.chunk(t, 1)[r].contiguous(), target.chunk(t, 1)[r].contiguous()


def sp_block_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: each step's input and target drawn; rank r receives only its sequence slice of each
    (the block stays the package's: every rank holds it whole)."""
    t, out = case.world_size, [{} for _ in range(case.world_size)]
    for step in range(STEPS):
        for k in (f"x{step}", f"t{step}"):
            for r, piece in enumerate(torch.randn(*SHAPE, generator=rng).chunk(t, 1)):
                out[r][k] = piece.contiguous()
    return out


def sp_block_exercise(case: Case, answer: Any, inputs: dict | None = None) -> dict:
    r, t, dev = distlab.rank(), distlab.world_size(), distlab.device()
    spb = answer(block(5).to(dev))
    opt = make_optimizer(spb.parameters())
    first: dict[str, Any] = {}
    traffic = []          # every step's: the parameters after all of them are judged
    for step in range(STEPS):
        distlab.engine.runtime.progress(f"sp_block: step {step}")
        mine = _sp_block_batch(step, r, t) if inputs is None else (inputs[f"x{step}"], inputs[f"t{step}"])
        x, target = (z.to(dev).clone() for z in mine)
        x.requires_grad_()
        with track_comm() as fwd:
            y = spb(x)
        loss = ((y - target) ** 2).sum() / (B * CFG.seq_len * CFG.d_model)   # my part of the mean
        with track_comm() as bwd:
            loss.backward()
        with track_comm() as sync:
            spb.allreduce_replicated_grads()
        traffic.append({"fwd": fwd.stats(), "bwd": bwd.stats(), "sync": sync.stats()})
        if step == 0:
            first = {"out": y.detach(), "x_grad": x.grad, "grads": {k: p.grad.clone() for k, p in
                                                                  spb.named_parameters() if p.grad is not None}}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {**first, "traffic": traffic, "params": {k: p.detach() for k, p in spb.named_parameters()}}


def sp_block_reference(case: Case, inputs: list | None = None) -> dict:
    ref = block(5)
    opt = make_optimizer(ref.parameters())
    first: dict[str, Any] = {}
    for step in range(STEPS):
        x, target = (_sp_block_batch(step, None, 1) if inputs is None else   # the drawn slices put back together
                     (torch.cat([i[f"{k}{step}"] for i in inputs], 1) for k in ("x", "t")))
        x.requires_grad_()
        y = ref(x)
        ((y - target) ** 2).mean().backward()
        if step == 0:
            first = {"out": y.detach(), "x_grad": x.grad,
                     "grads": {k: p.grad.clone() for k, p in ref.named_parameters()}}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {**first, "params": {k: p.detach() for k, p in ref.named_parameters()}}


def sp_block_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    t = case.world_size

    def values() -> str:
        def check(r: int, out: dict) -> None:
            same(out["out"], ref["out"].chunk(t, 1)[r], "the output (my slice of the sequence)")
            same(out["x_grad"], ref["x_grad"].chunk(t, 1)[r], "the input gradient (my slice)")
            names, want = set(out["grads"]), set(ref["grads"])
            expect(names == want, f"gradients of {sorted(names)}; expected {sorted(want)} "
                                  "(attributes ln1, attn, ln2, mlp, as in Block)")
            for k in sorted(want):
                replicated = k.startswith("ln") or k in ("attn.wo.bias", "mlp.out.bias")
                what = f"the gradient of {k}" + (" (after allreduce_replicated_grads)" if replicated else "")
                same(out["grads"][k], shard_of(k, ref["grads"][k], r, t), what, ATOL, 1e-4)
        return values_line(outputs, check)

    def training() -> str:
        def check(r: int, out: dict) -> None:
            for k in sorted(ref["params"]):
                if k not in out["params"]:
                    raise CheckFailed(f"no parameter {k}")
                same(out["params"][k], shard_of(k, ref["params"][k], r, t), f"{k} after {STEPS} steps",
                     TRAIN_ATOL, TRAIN_RTOL)
        values_line(outputs, check)
        return f"{STEPS} SGD steps match one process"

    def traffic() -> str:
        numel, h = B * CFG.seq_len * CFG.d_model, CFG.d_model
        two = (2, 2 * half_of(numel, t)[1])
        ln = all_reduce_of(6 * h, t)[1]     # LayerNorms 4h, row-parallel biases 2h
        for r, out in enumerate(outputs):
            expect(len(out["traffic"]) == STEPS, f"rank {r}: {len(out['traffic'])} metered steps, expected {STEPS}")
            for step, got in enumerate(out["traffic"]):       # every step: its parameters are judged
                at = f"rank {r}" + (f" (step {step})" if step else "")
                expect_traffic(f"{at}, forward", got["fwd"], {"all_gather": two, "reduce_scatter": two})
                expect_traffic(f"{at}, backward", got["bwd"], {"all_gather": two, "reduce_scatter": two})
                sent = got["sync"].bytes
                if set(sent) != {"all_reduce"} or sent["all_reduce"] != ln:
                    raise CheckFailed(f"{at}, allreduce_replicated_grads: sent {dict(sent)} B; expected "
                                      f"all-reduces of the 6h replicated gradients (LayerNorms, row biases): {ln} B")
        return ("per block 2 all-gathers + 2 reduce-scatters forward and backward (the bytes of TP's "
                "4 all-reduces), and the replicated parameters' gradients")

    return [check_line(case.lines[0], values), check_line(case.lines[1], training), check_line(case.lines[2], traffic)]
