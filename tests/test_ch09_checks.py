"""Chapter 9's graded tasks: the solution passes, the stubs fail, and typical wrong answers fail the line
that names their mistake (verdict lines asserted)."""
from __future__ import annotations

import torch

from distlab.checks.ch09 import TASKS, flat_shard
from labkit import answers, run

LAB = "09_training"

SAME_ORDER_EVERY_EPOCH = '''
def rank_windows(step, rank, world_size, batch_size, n_windows, seed):
    per = batch_size // world_size
    g = torch.arange(step * batch_size + rank * per, step * batch_size + (rank + 1) * per)
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))[g % n_windows]
'''
PER_RANK_STREAMS = '''
def rank_windows(step, rank, world_size, batch_size, n_windows, seed):
    per = batch_size // world_size      # each rank walks its own share of the windows: depends on N
    share = torch.arange(rank, n_windows, world_size)
    return share[(step * per + torch.arange(per)) % share.numel()]
'''
KEEPS_OLD_PADDING = '''
def load_shard(ckpt_dir, rank, world_size):
    saved = sorted((torch.load(os.path.join(ckpt_dir, f)) for f in os.listdir(ckpt_dir) if f.endswith(".pt")),
                   key=lambda d: d["rank"])
    out = {}
    for key in saved[0]["shard"]:
        full = torch.cat([d["shard"][key] for d in saved])          # the old padding kept
        s = math.ceil(full.numel() / world_size)
        out[key] = torch.cat([full, full.new_zeros(s * world_size - full.numel())])[rank * s:(rank + 1) * s]
    return out
'''


def _lines(lines):
    return [str(line) for line in lines]


def test_solution_passes_and_wrong_answers_fail_their_line(no_orphans):
    ns = answers(LAB)
    assert all(line.ok for line in run(LAB, "loader", ns)), _lines(run(LAB, "loader", ns))
    same = _lines(run(LAB, "loader", answers(LAB, replace={"rank_windows": SAME_ORDER_EVERY_EPOCH})))
    assert same[0].startswith("FAIL loader: disjoint") and "same order" in same[0], same
    own = _lines(run(LAB, "loader", answers(LAB, replace={"rank_windows": PER_RANK_STREAMS})))
    assert own[1].startswith("FAIL loader: resumable") and "differs" in own[1], own
    ckpt = run(LAB, "checkpoint", ns)
    assert [line.ok for line in ckpt] == [True, True], _lines(ckpt)
    padded = _lines(run(LAB, "checkpoint", answers(LAB, replace={"load_shard": KEEPS_OLD_PADDING})))
    assert all(line.startswith("FAIL checkpoint") for line in padded), padded


def test_drawn_inputs_are_judged_against_the_grader_reference():
    """Under grading: a secret size of 1 mod 4 (4 ranks pad 3 elements), every rank only its own shard."""
    task = TASKS["checkpoint"]
    case = task.cases()[0]
    inputs = task.inputs(case, torch.Generator().manual_seed(5))
    numel = int(inputs[0]["numel"])
    assert numel % 4 == 1 and all(set(i) == {"param", "exp_avg", "exp_avg_sq", "numel"} for i in inputs)
    ref = task.reference(case, inputs)
    whole = torch.cat([i["param"] for i in inputs])[:numel]
    assert torch.equal(ref[3][2]["param"], flat_shard(whole, 2, 3))


LOCAL_LOSS = '''
def train_steps(zero, batches):
    losses = []
    for x, y in batches:
        loss = lm_loss(zero, x, y)
        loss.backward()
        zero.optimizer.step()
        zero.optimizer.zero_grad()
        losses.append(float(loss))          # this rank's rows only: not the global batch's loss
    return losses
'''
NO_ZERO_GRAD = LOCAL_LOSS.replace("        zero.optimizer.zero_grad()\n", "").replace(
    "losses.append(float(loss))          # this rank's rows only: not the global batch's loss",
    "t = loss.detach().clone(); dist.all_reduce(t); losses.append(float(t) / dist.get_world_size())")
WEIGHTS_ONLY = '''
def load_state(ckpt_dir, zero):
    saved = torch.load(os.path.join(ckpt_dir, f"rank{distlab.rank()}_of_{distlab.world_size()}.pt"))
    with torch.no_grad():
        for p, value in zip([p for g in zero.optimizer.param_groups for p in g["params"]], saved["shards"]):
            p.copy_(value)
    return saved["step"]                    # AdamW's moments and step count left fresh
'''


def test_zero3_curve_and_resume_stubs_fail_and_wrong_answers_name_their_mistake(no_orphans):
    """The PRELUDE's ZeRO3 (GradingZeRO3, lab 5's interface: what `distlab grade` runs); the solution with the
    notebook's route (lab 5's class) passes in the solution notebook's check cells."""
    stubs = answers(LAB, stub=True)
    for task in ("zero3_curve", "resume"):
        lines = _lines(run(LAB, task, stubs))
        assert all(line.startswith("FAIL") and "not implemented yet" in line for line in lines), lines
    # the solution's PASS lines are the solution notebook's check cells (nbval), not run again here
    local = _lines(run(LAB, "zero3_curve", answers(LAB, replace={"train_steps": LOCAL_LOSS})))
    assert local[0].startswith("FAIL") and "differ from rank 0's" in local[0] and "all_reduce" in local[0], local
    stale = _lines(run(LAB, "zero3_curve", answers(LAB, replace={"train_steps": NO_ZERO_GRAD})))
    assert stale[0].startswith("FAIL zero3_curve") and "step 2:" in stale[0] and "zero_grad" in stale[0], stale
    moments = _lines(run(LAB, "resume", answers(LAB, replace={"load_state": WEIGHTS_ONLY})))
    assert moments[0].startswith("PASS") and moments[1].startswith("FAIL resume"), moments
    assert "step 3" in moments[1] and "optimizer's state" in moments[1], moments
