"""Lab 10's graded checks: the solution passes every line on drawn (secret) inputs (on gloo, under the device
audit; the uneven all-to-all tasks also on the strict backend; on the package's fixed inputs the solution
notebook passes them under nbval); the unfilled lab fails every line; a plausible mistake fails the line
that names it.

The answers are the solution notebook's answer cells, run after the lab's PRELUDE (as `distlab grade` runs a
learner's cells).
"""
from __future__ import annotations

import types

import torch

from distlab.checks import ch10
from distlab.checks.task import Case, run_task
from labkit import with_cases

LAB = "10_moe"


def _answers(stub: bool = False, replace: dict[str, str] | None = None) -> types.SimpleNamespace:
    from labkit import answer_sources
    ns: dict = {"__name__": f"answers_{LAB}"}
    exec(compile(ch10.PRELUDE, "<prelude>", "exec"), ns)  # noqa: S102 - test fixture
    for i, src in enumerate(answer_sources(LAB, stub=stub)):
        exec(compile(src, f"<answer cell {i}>", "exec"), ns)  # noqa: S102
    for name, src in (replace or {}).items():
        exec(compile(src, f"<replaced {name}>", "exec"), ns)  # noqa: S102
    return types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})


def _args(task, ns):
    return [getattr(ns, name) for name in task.answers]


def _strict(task, case, answers):
    from distlab.checks.task import _exercise_on_rank
    from distlab.engine.launch import run_on_ranks
    return run_on_ranks(_exercise_on_rank, case.world_size, args=(task, case, tuple(answers)), strict=True,
                        stall=10)


def _with_inputs(task, case, answers, inputs):
    r = __import__("distlab").rank()
    return task.exercise(case, *answers, inputs=inputs[r])


def _drawn(task, ns, seed=1234, only_first=False):
    """The grader's route: every rank's inputs drawn, the reference computed from them, each rank given its own."""
    from distlab.checks.task import validate
    from distlab.engine.launch import run_on_ranks
    from distlab.grading import secret
    lines = []
    for case in task.cases()[:1] if only_first else task.cases():
        inputs = task.inputs(case, torch.Generator().manual_seed(seed))
        assert len(inputs) == case.world_size and all(v.device.type == "cpu" for d in inputs for v in d.values())
        assert max(len(secret.blob(d)) for d in inputs) + 8 <= secret.MAX_BYTES      # each within one FIFO
        ref = task.reference(case, inputs=inputs)
        outs = run_on_ranks(_with_inputs, case.world_size, args=(task, case, tuple(_args(task, ns)), inputs))
        validate(outs)
        lines += task.judge(case, outs, ref)
    return lines


def test_the_stubs_fail_every_line():
    # (the solution passes every line on the fixed inputs in solutions/10_moe.ipynb, under nbval)
    stubs = _answers(stub=True)
    for name, task in ch10.TASKS.items():
        bad = run_task(task, _args(task, stubs))
        assert bad and not any(line.ok for line in bad), [str(line) for line in bad if line.ok]


def test_the_uneven_all_to_all_passes_on_the_strict_backend():
    ns = _answers()
    for name in ("dispatch_combine", "ep_layer"):
        task = ch10.TASKS[name]
        one = with_cases(task, task.cases()[:1] if name == "ep_layer" else task.cases())
        lines = run_task(one, _args(task, ns), run=_strict)
        assert lines and all(line.ok for line in lines), [str(line) for line in lines if not line.ok]


def test_drawn_inputs_are_judged_against_their_own_reference():
    ns = _answers()
    for name, task in ch10.TASKS.items():
        lines = _drawn(task, ns, only_first=name == "ep_layer")
        assert lines and all(line.ok for line in lines), (name, [str(line) for line in lines if not line.ok])
    # the drawn inputs are not the package's fixed ones: the notebook's reference would not match them
    task = ch10.TASKS["router"]
    case = task.cases()[0]
    drawn = task.reference(case, inputs=task.inputs(case, torch.Generator().manual_seed(1)))
    assert not torch.equal(drawn[1]["expert"], task.reference(case)[1]["expert"])


# Mistakes a learner makes, and the line that must say so.
SECOND_CHOICES_FIRST = '''
def route(logits, k, capacity=None):
    t, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    weight, expert = probs.topk(k, dim=-1)
    weight = weight / weight.sum(dim=-1, keepdim=True)
    order = expert.reshape(-1)                           # token-major: token 0's choices, then token 1's, ...
    pos = (F.one_hot(order, e).cumsum(0) - 1).gather(1, order[:, None])[:, 0]
    slot = pos.view(t, k)
    if capacity is not None:
        slot = torch.where(slot < capacity, slot, torch.full_like(slot, -1))
    return expert, weight.to(logits.dtype), slot
'''
EVEN_SPLITS = '''
def combine(y, recv_counts, counts, group=None):
    out = torch.empty(int(counts.sum()), y.shape[1], device=y.device)
    dist.all_to_all_single(out, y)                       # even splits: wrong sizes, and no gradient
    return out
'''
ALL_GATHER_INSTEAD = '''
def dispatch(x, counts, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(n, -1)
    sizes = [torch.empty(1, dtype=torch.long, device=x.device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device))      # another collective
    in_splits = counts.view(n, -1).sum(1).tolist()
    out_splits = recv_counts.sum(1).tolist()
    return AllToAll.apply(x, out_splits, in_splits, group), recv_counts
'''


def _first(task_name, **replace):
    task = ch10.TASKS[task_name]
    one = with_cases(task, task.cases()[:1])
    return [str(line) for line in run_task(one, _args(task, _answers(replace=replace)))]


def test_mistakes_fail_the_line_that_names_them():
    router = _first("router", route=SECOND_CHOICES_FIRST)
    assert router[0].startswith("PASS") and router[1].startswith("FAIL router, capacity"), router
    combine = _first("dispatch_combine", combine=EVEN_SPLITS)
    assert combine[0].startswith("FAIL dispatch_combine, 2 ranks, values"), combine
    gathered = _first("dispatch_combine", dispatch=ALL_GATHER_INSTEAD)
    assert [line[:4] for line in gathered] == ["PASS", "PASS", "FAIL"], gathered
    assert "all_gather x1" in gathered[2], gathered
