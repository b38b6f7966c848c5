"""Chapter 7's graded checks reject wrong, cheating and hanging answers, not only missing ones; and a
multi-rank measurement of PyTorch's TP and SP bytes equals the closed forms.

Each test runs one task of lab 7 with the solution's answers, one answer replaced by a plausible
mistake, and asserts which verdict lines fail and which still pass (so a failing line points at the
mistake, not at everything). A wrong answer runs the 2-rank case only: on 4 ranks it takes the same code
path (the solution passes every case, 2 and 4 ranks, in solutions/07 under nbval). That the stubs fail every line is tests/test_labs.py's
`test_unfilled_lab_fails_every_graded_line`, run for every lab.
"""
from __future__ import annotations

import dataclasses
import time

import pytest


LAB = "07_tensor_parallel"


# labkit is imported inside the helpers, not at the top: a rank that runs `_torch_tp_bytes` below imports
# this module, and labkit's imports (nbformat, jsonschema) cost ~3 s of CPU per rank on this box.

def _lines(task, **replace):
    from labkit import answers, run
    return [str(line) for line in run(LAB, task, answers(LAB, replace=replace))]


def _first_case(task, **replace):
    """The verdict lines of the task's first case only (2 ranks): a wrong answer takes the same code
    path on 4 ranks, and the solution passes every case in solutions/07 (nbval)."""
    from distlab.checks import lab_module, run_task
    from labkit import answers, with_cases
    t = lab_module(LAB).TASKS[task]
    first = t.cases()[0]
    assert first.world_size == 2
    one = with_cases(t, [first])
    ns = answers(LAB, replace=replace)
    return [str(line) for line in run_task(one, [getattr(ns, name) for name in t.answers])]


def _status(lines):
    return ["PASS" if line.startswith("PASS") else "FAIL" for line in lines]


G_WITHOUT_ALL_REDUCE = '''
class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        return x.clone()
    @staticmethod
    def backward(ctx, grad):
        return grad, None
'''
# Only rank 0 of the group all-reduces in g's forward: the others never join.
G_THAT_HANGS = '''
class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        x = x.clone()
        if dist.get_rank() == 0:
            dist.all_reduce(x, group=group)
        return x
    @staticmethod
    def backward(ctx, grad):
        return grad, None
'''


def test_g_without_its_all_reduce_fails_values_and_traffic(no_orphans):
    out = _first_case("f_g", ReduceFromTP=G_WITHOUT_ALL_REDUCE)
    assert _status(out) == ["FAIL"] * 2, out
    assert out[0].startswith("FAIL f_g, 2 ranks, values: rank 0: max |g's output (the sum over the group) - reference|")
    assert out[1] == ("FAIL f_g, 2 ranks, traffic: rank 0, g forward: sent nothing; "
                      "expected all_reduce x1 (4096 B)")


def test_a_g_that_only_rank_0_calls_is_reported_as_a_hang_in_seconds(no_orphans, short_stall):
    start = time.monotonic()
    out = _lines("f_g", ReduceFromTP=G_THAT_HANGS)
    assert time.monotonic() - start < 60
    assert out[0].startswith(f"FAIL f_g, 2 ranks, values: hung: rank(s) [0] waited {short_stall} s"), out[0]
    assert "(case: g (ReduceFromTP): forward, then backward)" in out[0]
    assert "every rank of the group must call the same all-reduce" in out[0]
    assert out[2:] == [f"FAIL f_g, {w}, {k}: not run: an earlier case (2 ranks) hung"
                       for w in ("4 ranks", "4 ranks in 2 groups") for k in ("values", "traffic")]


COLUMN_KEEPS_EVERYTHING = '''
class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        self.t, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.weight, self.bias = linear.weight, linear.bias       # the whole layer on every rank
    def forward(self, x):
        return F.linear(x, self.weight.chunk(self.t, 0)[self.r], self.bias.chunk(self.t, 0)[self.r])
'''


def test_a_column_layer_that_keeps_the_whole_weight_fails_shards_only(no_orphans):
    out = _first_case("column", ColumnParallelLinear=COLUMN_KEEPS_EVERYTHING)
    assert _status(out) == ["FAIL", "FAIL", "PASS"], out
    assert "parameter bias has shape (128,), expected (64,)" in out[0]


ROW_BIAS_BEFORE_REDUCE = '''
class RowParallelLinear(nn.Module):
    def __init__(self, linear, group=None, reduce=ReduceFromTP):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.reduce = group, reduce
        self.weight = nn.Parameter(linear.weight.detach().chunk(t, 1)[r].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
    def forward(self, x):
        return self.reduce.apply(F.linear(x, self.weight, self.bias), self.group)   # bias added t times
'''


def test_adding_the_row_bias_before_the_reduction_fails_values(no_orphans):
    out = _first_case("row", RowParallelLinear=ROW_BIAS_BEFORE_REDUCE)
    assert _status(out) == ["PASS", "FAIL", "PASS"], out
    assert "the output" in out[1]


MLP_WITHOUT_F = '''
class TensorParallelMLP(nn.Module):
    def __init__(self, mlp, group=None, enter=CopyToTP, exit=ReduceFromTP):
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, group)
        self.out = RowParallelLinear(mlp.out, group, reduce=exit)
    def forward(self, x):                  # no f: the input gradient stays this rank's part
        return self.out(F.gelu(self.fc(x)))
'''


def test_an_mlp_without_f_has_the_right_output_but_not_the_input_gradient(no_orphans):
    out = _first_case("mlp", TensorParallelMLP=MLP_WITHOUT_F)
    assert _status(out) == ["PASS", "FAIL", "FAIL"], out
    assert "the input gradient" in out[1]
    assert "backward: sent nothing; expected all_reduce x1" in out[2]


ATTENTION_F_PER_PROJECTION = '''
class TensorParallelAttention(nn.Module):
    def __init__(self, attn, group=None, enter=CopyToTP, exit=ReduceFromTP):
        super().__init__()
        self.group, self.enter = group, enter
        self.head_dim, self.p = attn.head_dim, attn.p
        self.wq, self.wk, self.wv = (ColumnParallelLinear(w, group) for w in (attn.wq, attn.wk, attn.wv))
        self.wo = RowParallelLinear(attn.wo, group, reduce=exit)
        self.register_buffer("causal", attn.causal, persistent=False)
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(self.enter.apply(x, self.group)).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))          # one f per projection: 3 all-reduces backward
        y = attention_core(q, k, v, self.causal[:s, :s], self.p, self.training)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))
'''


def test_one_f_per_projection_is_right_but_fails_traffic(no_orphans):
    out = _first_case("attention", TensorParallelAttention=ATTENTION_F_PER_PROJECTION)
    assert _status(out) == ["PASS", "PASS", "FAIL"], out
    assert out[2] == ("FAIL attention, 2 ranks, traffic: rank 0, backward: sent all_reduce x3 (12288 B); "
                      "expected all_reduce x1 (4096 B)")


NO_TENSOR_PARALLELISM = '''
def tensor_parallel(model, group=None):
    return model           # every rank trains the whole model: right losses, nothing split
'''


def test_a_model_left_whole_fails_parameters_and_traffic(no_orphans):
    out = _first_case("train", tensor_parallel=NO_TENSOR_PARALLELISM)
    assert _status(out) == ["FAIL", "FAIL"], out
    assert "blocks.0.attn.wk.bias after 3 steps has shape (32,), expected (16,)" in out[0]
    assert "sent nothing; expected all_reduce x8" in out[1]


GATHER_BACKWARD_SLICES = '''
class GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)
    @staticmethod
    def backward(ctx, grad):       # my slice of my gradient: forgets the other ranks' contributions
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=1)[r].contiguous(), None
'''


def test_an_all_gather_whose_backward_does_not_reduce_fails(no_orphans):
    out = _first_case("sp_ops", GatherFromSP=GATHER_BACKWARD_SLICES)
    assert _status(out) == ["FAIL", "FAIL"], out
    assert "GatherFromSP's input gradient" in out[0]
    assert "gather backward: sent nothing; expected reduce_scatter x1" in out[1]


SP_WITHOUT_GRAD_SYNC = '''
class SequenceParallelBlock(nn.Module):
    def __init__(self, block, group=None):
        super().__init__()
        self.group = group
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attn = TensorParallelAttention(block.attn, group, enter=GatherFromSP, exit=ReduceScatterToSP)
        self.mlp = TensorParallelMLP(block.mlp, group, enter=GatherFromSP, exit=ReduceScatterToSP)
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
    def allreduce_replicated_grads(self):
        pass
'''


def test_forgetting_the_replicated_gradients_fails_values_training_and_traffic(no_orphans):
    out = _first_case("sp_block", SequenceParallelBlock=SP_WITHOUT_GRAD_SYNC)
    assert _status(out) == ["FAIL"] * 3, out
    assert "(after allreduce_replicated_grads)" in out[0]
    assert "allreduce_replicated_grads: sent {} B; expected all-reduces" in out[2]


def test_forged_outputs_are_judged_outside_the_ranks(no_orphans):
    from distlab.checks import run_task
    from distlab.checks.ch07 import TASKS

    def forged(case, answer):
        return {"out": "a tensor, honestly", "fwd": 42}

    out = [str(line) for line in run_task(dataclasses.replace(TASKS["mlp"], exercise_fn=forged), [object])]
    assert all(line.startswith("FAIL") and "malformed result" in line for line in out), out


# ---- PyTorch's TP and SP, measured on ranks, against the closed forms -------------------------------

def _torch_tp_bytes() -> dict:
    import torch

    import distlab
    from distlab.meters import track_comm
    from distlab.course.tensor_parallel.model import TP_PRESETS, build_stack, parallelize_blocks
    cfg, r, t = TP_PRESETS["tp-tiny"], distlab.rank(), distlab.world_size()
    out = {}
    for sp in (False, True):
        model = parallelize_blocks(build_stack(cfg, seed=0), distlab.mesh(), sp=sp)
        x = torch.randn(4, cfg.seq_len, cfg.d_model, device=distlab.device())
        x = x.chunk(t, 1)[r].contiguous() if sp else x
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with track_comm() as step:
            model(x).sum().backward()
        with track_comm() as update:
            opt.step()
        out[sp] = {"step": step.stats(), "update": update.stats()}
    return out


def test_torch_tp_and_sp_bytes_equal_the_theory(no_orphans):
    import distlab
    from distlab.theory import tensor_parallel as th
    from distlab.course.tensor_parallel.model import TP_PRESETS
    cfg, t = TP_PRESETS["tp-tiny"], 2
    tokens, L, h = 4 * cfg.seq_len, cfg.n_layers, cfg.d_model
    for out in distlab.launch(_torch_tp_bytes, t):
        tp, sp = out[False], out[True]
        assert tp["step"].calls == {"all_reduce": 4 * L}
        assert tp["step"].total_bytes == L * th.tp_block_bytes(tokens, h, t, bytes_per_element=4)
        assert tp["update"].calls == {}
        assert sp["step"].calls == {"all_gather": 4 * L, "reduce_scatter": 4 * L}
        assert sp["step"].total_bytes == L * th.sp_block_bytes(tokens, h, t, bytes_per_element=4)
        assert sp["update"].calls == {"all_reduce": 4 * L}     # the LayerNorms' Partial gradients, in the optimizer
        assert sp["update"].total_bytes == L * th.sp_replicated_grad_bytes(h, t, biases=False)


# The other ranks' share of a row-parallel output computed locally from the package's seeded input (every rank
# holds the whole layer), nothing reduced: right values in the notebook, where the input is the package's.
PREDICTED_ROW = '''
from distlab.checks.ch07_common import B as _B, CFG as _CFG, randn as _randn
class RowParallelLinear(RowParallelLinear):
    def __init__(self, linear, group=None, reduce=ReduceFromTP):
        super().__init__(linear, group, reduce)
        t, r = dist.get_world_size(), dist.get_rank()
        xs, ws = _randn(_B, _CFG.seq_len, _CFG.d_ff, seed=7).chunk(t, -1), linear.weight.detach().cpu().chunk(t, 1)
        self.others = sum(F.linear(xs[o], ws[o]) for o in range(t) if o != r).to(linear.weight.device)

    def forward(self, x):
        return F.linear(x, self.weight) + self.others + self.bias
'''


def test_a_row_output_rebuilt_from_the_package_s_input_fails_values_under_grading(no_orphans):
    from labkit import answers
    from test_ch08_checks import graded_lines
    mine = _first_case("row", RowParallelLinear=PREDICTED_ROW)
    assert mine[1].startswith("PASS row, 2 ranks, values"), mine
    assert mine[2].startswith("FAIL row, 2 ranks, traffic: rank 0, forward: sent nothing"), mine
    # under grading the input is drawn and each rank holds only its columns of it
    graded = graded_lines("row", answers(LAB, replace={"RowParallelLinear": PREDICTED_ROW}), lab=LAB)
    assert graded[1].startswith("FAIL row, 2 ranks, values: rank 0: max |the output - reference|"), graded
    assert graded[2].startswith("FAIL row, 2 ranks, traffic: rank 0, forward: sent nothing"), graded
