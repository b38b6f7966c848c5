"""Chapter 5's graded tasks reject wrong, cheating and hanging ZeRO-3 answers;
the package pieces the lab builds on (units, the overlap arithmetic) hold without ranks.

Each test replaces one piece of the solution (`labkit.answers(..., replace=...)`) and runs the task it
belongs to, on one world size where one is enough, asserting on the verdict lines themselves.
That the unfilled lab's stubs fail every line is tests/test_labs.py's, for every lab.
"""
from __future__ import annotations

import time

import pytest
import torch.distributed as dist
import torch

from distlab.checks.ch05 import TASKS
from distlab.course.models import build_model
from distlab.theory import overlap
from distlab.theory.hardware import A100, H100
from distlab.course.zero.units import Unit, block_units, direct_params, qualified_names, whole_model_unit
from labkit import answer_sources, answers, run

LAB = "05_zero3"


def _lines(lines):
    return [str(line) for line in lines]


def _case(task: str, ns, n: int):
    """The verdict lines of one task's case on `n` ranks only (references cached as in run_task)."""
    from distlab.checks.task import launch_exercise, reference_of, validate
    t = TASKS[task]
    case = next(c for c in t.cases() if c.world_size == n)
    outputs = launch_exercise(t, case, tuple(getattr(ns, a) for a in t.answers))
    validate(outputs)
    return _lines(t.judge(case, outputs, reference_of(t, case)))


# ---- no ranks ------------------------------------------------------------------------------------

def test_block_units_cover_every_parameter_once_in_forward_order():
    model = build_model("tiny", device="cpu")
    units = block_units(model)
    assert [type(m).__name__ for m in units[0]] == ["Embedding", "Embedding"]
    assert [type(m).__name__ for m in units[-1]] == ["LayerNorm", "Linear"]
    params = [p for mods in units for m in mods for _, _, p in direct_params(m)]
    assert len(params) == len(list(model.parameters())) and len({id(p) for p in params}) == len(params)
    assert whole_model_unit(model) == [[model]]
    made = [Unit(i, mods) for i, mods in enumerate(units)]
    for u in made:
        u.names = [(o, n, p.shape, p.numel()) for m in u.modules for o, n, p in direct_params(m)]
    assert qualified_names(model, made)[1][0] == "blocks.0.ln1.weight"


def test_tokens_to_hide_is_f_over_beta_for_zero3_in_bf16():
    # 6 Psi T / F >= 3 * 2 * Psi / beta  <=>  T >= F / beta (N -> infinity)
    assert overlap.tokens_to_hide(H100, "nvlink") == pytest.approx(989e12 / 450e9)
    assert overlap.tokens_to_hide(H100, "ib") == pytest.approx(989e12 / 50e9)
    assert overlap.tokens_to_hide(H100, "ib") / overlap.tokens_to_hide(H100, "nvlink") == pytest.approx(H100.node_gap)
    assert overlap.tokens_to_hide(A100, "nvlink", utilisation=0.5, world_size=8) == pytest.approx(
        0.5 * 312e12 / 300e9 * 7 / 8)
    assert overlap.tokens_to_hide(H100, "nvlink", passes=2) == pytest.approx(2 / 3 * 989e12 / 450e9)  # DDP, ZeRO-1/2
    compute, comm = overlap.seconds(7.5e9, overlap.tokens_to_hide(H100, "ib", world_size=64), 64, H100, "ib")
    assert compute == pytest.approx(comm)
    with pytest.raises(ValueError):
        overlap.tokens_to_hide(H100, "pcie")


# ---- wrong, cheating and hanging answers ------------------------------------------------------------

def _class_with(old: str, new: str) -> str:
    src = answer_sources(LAB)[0]
    assert old in src, "the solution changed: update this test"
    return src.replace(old, new)


def test_a_skipped_broadcast_is_reported_as_a_hang_in_seconds(no_orphans, short_stall):
    # Rank 1 skips the broadcast of the last unit: rank 0 waits for it forever.
    hang = _class_with("            dist.broadcast(full, src=0)",
                       "            if self.rank != 1 or unit.index < len(self.units) - 1:\n"
                       "                dist.broadcast(full, src=0)")
    start = time.monotonic()
    out = _lines(run(LAB, "shard", answers(LAB, replace={"ZeRO3": hang})))
    assert time.monotonic() - start < 90
    assert out[0].startswith("FAIL shard, 2 ranks: rank r keeps slice r of rank 0's weights, unit by unit: "
                             f"hung: rank(s) [0] waited {short_stall} s"), out
    assert "(case: ZeRO3(model) on 2 ranks, per-block units)" in out[0] and "rank 0 waits in __init__ (" in out[0]
    assert "every rank must gather and reduce-scatter the same units in the same order" in out[0]
    assert all(line.endswith("not run: an earlier case (2 ranks) hung") for line in out[2:]), out


def test_own_weights_instead_of_rank_0s_fail_the_values(no_orphans):
    ns = answers(LAB, replace={"ZeRO3": _class_with("            dist.broadcast(full, src=0)", "            pass")})
    out = _case("shard", ns, 2)
    assert out[0].startswith("FAIL shard, 2 ranks: rank r keeps slice r of rank 0's weights, unit by unit: "
                             "max |rank 1's shard of unit 0 - reference|"), out
    assert out[1].startswith("FAIL shard, 2 ranks: nothing else (the module's parameters freed): rank 0: "
                             "construction called {}"), out


NO_FREE = '''
@distlab.add_to_class(ZeRO3)
def _free(self, unit):
    pass            # forgot to drop unit.full: every unit stays gathered
'''


def test_units_kept_after_forward_fail_the_gather_line(no_orphans):
    out = _case("forward", answers(LAB, replace={"_free": NO_FREE}), 2)
    assert out[0].startswith("PASS forward, 2 ranks: the same logits as one process"), out
    assert out[1].startswith("FAIL forward, 2 ranks: one all-gather per unit, freed after use: rank 0: after "
                             "forward 4 unit(s) still gathered"), out


KEEP_SAVED = '''
@distlab.add_to_class(ZeRO3)
def _pack(self, t):
    return t        # autograd keeps the gathered weights alive until backward
'''


def test_weights_kept_by_autograd_fail_the_regather_line(no_orphans):
    out = _case("backward", answers(LAB, replace={"_pack": KEEP_SAVED}), 2)
    assert out[0].startswith("PASS backward, 2 ranks: every unit's gradient"), out
    assert out[1].startswith("FAIL backward, 2 ranks: gathered again for backward, not kept by autograd: rank 0: "
                             "between forward and backward autograd kept"), out


def _step4(old: str, new: str) -> str:
    src = answer_sources(LAB)[3]
    assert old in src, "the solution changed: update this test"
    return src.replace(old, new)


ALL_REDUCE = '''
@distlab.add_to_class(ZeRO3)
def _reduce_scatter(self, unit, grads):
    self._free(unit)
    flat = torch.zeros(unit.padded, dtype=self.gather_dtype, device=unit.shard.device)
    offset = 0
    for (_, _, _, k), g in zip(unit.names, grads):
        if g is not None:
            flat[offset:offset + k].copy_(g.reshape(-1))
        offset += k
    dist.all_reduce(flat)                      # the whole gradient on every rank: 2x the bytes
    per = unit.padded // self.n
    g = flat[self.rank * per:(self.rank + 1) * per] / self.n
    unit.shard.grad = g if unit.shard.grad is None else unit.shard.grad + g
'''


@pytest.mark.parametrize("replace, failing, passing", [
    ({"_reduce_scatter": _step4("    flat.div_(self.n)\n", "")}, [0, 1], [2, 3]),      # a sum, not a mean
    ({"_reduce_scatter": ALL_REDUCE}, [2], [0, 1]),                                     # cheap to write, 2x bytes
], ids=["sums-gradients", "all-reduce"])
def test_train_rejects_wrong_values_and_wrong_collectives(replace, failing, passing, no_orphans):
    out = _case("train", answers(LAB, replace=replace), 2)
    assert all(out[i].startswith("FAIL ") for i in failing), out
    assert all(out[i].startswith("PASS ") for i in passing), out


def test_no_prefetch_fails_the_order_not_the_values(no_orphans):
    src = '@distlab.add_to_class(ZeRO3)\ndef _prefetch(self, unit, direction):\n    pass\n'
    out = _case("prefetch", answers(LAB, replace={"_prefetch": src}), 2)
    assert out[0].startswith("PASS prefetch, 2 ranks: matches one process, same traffic"), out
    assert out[1].startswith("FAIL prefetch, 2 ranks: the next unit's all-gather starts before this unit computes: "
                             "rank 0: in forward, unit 1's all-gather started after unit 0 began computing"), out


FP32_WIRE = '''
@distlab.add_to_class(ZeRO3)
def _start_gather(self, unit):
    if unit.full is not None or unit.pending is not None:
        return
    buf = torch.empty(unit.padded, dtype=torch.float32, device=unit.shard.device)   # ignores gather_dtype
    unit.pending = (all_gather_tensor(buf, unit.shard.detach(), async_op=True), buf)
'''


def test_fp32_gathers_fail_the_bf16_wire_line(no_orphans):
    out = _lines(run(LAB, "bf16", answers(LAB, replace={"_start_gather": FP32_WIRE})))
    assert out[0].startswith("FAIL bf16, 2 ranks: bf16 on the wire, 3Ψ·2·(N-1)/N: rank 0: "), out


# ---- the class as an ordinary module: parameters, replicate=, state_dict ---------------------------

STEPS, BATCH, LR = 3, 8, 1e-2


def _sgd(params, lr=LR):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _as_module(ZeRO3, ckpt):
    """On every rank: the solution's ZeRO3 trained by plain torch optimizers over `parameters()`."""
    import distlab
    from distlab.course.models import PRESETS, lm_loss, split_batch, synthetic_batch
    from distlab.meters import track_comm
    n, r, cfg = distlab.world_size(), distlab.rank(), PRESETS["tiny"]
    batches = [split_batch(synthetic_batch(s, BATCH, cfg), r, n) for s in range(STEPS)]

    def step(zero, opt, s):
        lm_loss(zero, *batches[s]).backward()
        opt.step()
        opt.zero_grad()

    out = {}
    zero = ZeRO3(build_model("tiny"))                                   # everything sharded
    opt = torch.optim.AdamW(zero.parameters(), lr=LR)
    out["names"] = [name for name, _ in zero.named_parameters()]
    lm_loss(zero, *batches[0]).backward()
    out["grads"] = [(p.grad is not None and p.grad.shape == p.shape) for p in zero.parameters()]
    opt.step()
    opt.zero_grad()
    for s in range(1, STEPS):
        step(zero, opt, s)
    out["adamw"] = zero.gather_full_params()

    for key, rule in (("ndim1", lambda name, p: p.ndim == 1), ("listed", ["tok", "pos", "blocks.0.ln1"])):
        zero = ZeRO3(build_model("tiny"), replicate=rule)
        opt = _sgd(zero.parameters())
        out[key, "names"] = [name for name, _ in zero.named_parameters()]
        out[key, "units"] = len(zero.units)
        for s in range(STEPS):
            with track_comm() as comm:
                lm_loss(zero, *batches[s]).backward()
            opt.step()
            opt.zero_grad()
            if s == STEPS - 2 and key == "ndim1":       # a checkpoint one step before the end
                torch.save({"model": zero.state_dict(), "opt": opt.state_dict()}, f"{ckpt}/rank{r}.pt")
        out[key, "calls"] = dict(comm.stats().calls)
        out[key] = zero.gather_full_params()

    dist.barrier()
    resumed = ZeRO3(build_model("tiny", seed=7), replicate=lambda name, p: p.ndim == 1)
    opt = _sgd(resumed.parameters())
    mine, other = (torch.load(f"{ckpt}/rank{k}.pt") for k in (r, 1 - r))
    before = [p.detach().clone() for p in resumed.parameters()]
    errors = []
    for bad in (other["model"], {**mine["model"], "_extra_state": {**mine["model"]["_extra_state"], "world_size": 4}}):
        try:
            resumed.load_state_dict(bad)
        except ValueError as exc:
            errors.append(str(exc))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, resumed.parameters()))
    out["errors"] = errors
    resumed.load_state_dict(mine["model"])
    opt.load_state_dict(mine["opt"])
    step(resumed, opt, STEPS - 1)
    out["resumed"] = resumed.gather_full_params()
    out["saved_keys"] = sorted(mine["model"])
    # One process on the whole batch, on a rank (the checks' references are computed so too): AdamW on
    # rank 0, SGD on rank 1, side by side, and this process never imports torch.optim's first-use machinery.
    from distlab.course.models import train_reference
    out["reference"] = train_reference("tiny", steps=STEPS, batch_size=BATCH, lr=LR,
                                       optimizer=torch.optim.AdamW if r == 0 else _sgd).params
    return out


def test_zero3_trains_with_plain_torch_optimizers_replicates_and_resumes(tmp_path, no_orphans):
    import distlab
    ZeRO3 = answers(LAB).ZeRO3
    outs = distlab.launch(_as_module, 2, args=(ZeRO3, str(tmp_path)))
    adamw, sgd = outs[0]["reference"], outs[1]["reference"]
    units = len(block_units(build_model("tiny", device="cpu")))
    for r, out in enumerate(outs):
        # parameters() is this rank's flat shards, one per unit, each with its reduced gradient shard
        assert out["names"] == [f"flat_shards.unit{i}" for i in range(units)], out["names"]
        assert all(out["grads"])
        # SGD: rounding (measured 1.5e-8). AdamW divides by sqrt(v): where a gradient is rounding noise (the
        # attention key bias's is 0 in exact arithmetic, ~1e-10 here) each process steps ±lr in its own
        # direction; measured 4e-4 there, 3e-5 elsewhere.
        for key, ref, tol in (("adamw", adamw, 1e-3), ("ndim1", sgd, 1e-6), ("listed", sgd, 1e-6)):
            assert set(out[key]) == set(ref)
            worst = max((out[key][k] - ref[k]).abs().max().item() for k in ref)
            assert worst < tol, (r, key, worst)
        # replicated: LayerNorms (ndim 1) under their names, after the shards; every unit still sharded
        rep = [k for k in out["ndim1", "names"] if not k.startswith("flat_shards.")]
        assert rep and all(k.startswith("module.") and ("ln" in k or "bias" in k) for k in rep), rep
        assert out["ndim1", "units"] == units
        assert out["ndim1", "calls"]["all_reduce"] == len(rep)       # one all-reduce per replicated gradient
        # by names: the embedding unit (tok + pos) is left with nothing to shard and is dropped
        assert out["listed", "units"] == units - 1
        assert [k for k in out["listed", "names"] if k.startswith("module.")] == [
            "module.tok.weight", "module.pos.weight", "module.blocks.0.ln1.weight", "module.blocks.0.ln1.bias"]
        # a rank saves its shards, the replicated parameters and the layout; resuming equals not stopping
        assert "_extra_state" in out["saved_keys"] and "flat_shards.unit0" in out["saved_keys"]
        assert all(torch.equal(out["resumed"][k], out["ndim1"][k]) for k in sgd), r
        wrong_rank, wrong_n = out["errors"]
        assert f"load the file rank {r} saved" in wrong_rank, wrong_rank
        assert "of 4, but this ZeRO3 runs on 2 ranks" in wrong_n and "load_shard" in wrong_n, wrong_n
        assert out["untouched"]                                      # refused before copying anything
    assert all(torch.equal(outs[0]["ndim1"][k], outs[1]["ndim1"][k]) for k in sgd)   # the ranks agree


def test_replicate_names_that_match_nothing_are_refused():
    with pytest.raises(ValueError, match=r"replicate names \['ln_x'\], which match no parameter of GPT"):
        from distlab.course.zero.units import _replicate_rule
        _replicate_rule(build_model("tiny", device="cpu"), ["ln_x"])
