"""Chapter 8's graded checks reject wrong, cheating and hanging answers, not only missing ones.

A wrong answer runs the 2-stage case only where the 4-stage one takes the same code path (the solution
passes every case in solutions/08 under nbval)."""
from __future__ import annotations

import time

from labkit import answers, run

LAB = "08_pipeline"

# GPipe handed in as 1F1B: right values and messages, too many activations held.
GPIPE_AS_1F1B = '''
def one_f_one_b_step(stage, x, y, m, micro_batch):
    return gpipe_step(stage, x, y, m, micro_batch)
'''
# The last rank computes the whole model itself: right logits, no pipeline.
LOCAL_FORWARD = '''
def pipeline_forward(stage, x, m, micro_batch):
    from distlab.course.models import build_model
    r, p = dist.get_rank(), dist.get_world_size()
    if r != p - 1:
        return None
    model = build_model("tiny", seed=0, n_layers=4)
    from distlab.course.models import synthetic_batch
    xs, _ = synthetic_batch(0, m * micro_batch, model.config)
    return model(xs)
'''
# Forgets to scale each micro-batch's loss by 1/m: gradients m times too large.
UNSCALED = '''
_stage_loss = stage_loss
def stage_loss(logits, targets):
    return _stage_loss(logits, targets) * 4
'''
# The last rank skips sending its last micro-batch's gradient: rank p-2 waits for ever.
DEADLOCK = '''
_p2p = p2p
def p2p(sends=(), recvs=()):
    r, p = dist.get_rank(), dist.get_world_size()
    if r == p - 1 and sends and not recvs and dist.get_world_size() == 2:
        return
    _p2p(sends, recvs)
'''
# "Offload" that keeps the plain optimizer on the device.
NOT_OFFLOADED = '''
from distlab.engine.precision import MixedPrecisionAdam
class OffloadAdam(MixedPrecisionAdam):
    pass
'''
# Copies the gradients to the host in step() instead of during the backward.
LATE_GRADS = '''
@distlab.add_to_class(OffloadAdam)
def _grad_ready(self, p):
    pass

_step = OffloadAdam.step
@distlab.add_to_class(OffloadAdam)
def step(self):
    for i, p in enumerate(self.params):
        self.buffers[i].copy_(p.grad)
        p.grad = None
    _step(self)
'''
NO_WEIGHT_DECAY = '''
_init = OffloadAdam.__init__
def _no_decay(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    _init(self, params, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
OffloadAdam.__init__ = _no_decay
'''


def _lines(lines):
    return [str(line) for line in lines]


def _first_case(task, ns):
    """The verdict lines of the task's first case only (2 stages): a wrong answer takes the same code
    path on 4 stages, and the solution passes every case in solutions/08 (nbval)."""
    from distlab.checks import lab_module, run_task
    from labkit import with_cases
    t = lab_module(LAB).TASKS[task]
    first = t.cases()[0]
    assert first.world_size == 2
    one = with_cases(t, [first])
    return _lines(run_task(one, [getattr(ns, name) for name in t.answers]))


def graded_lines(task, ns, case_index=0, lab=LAB):
    """One case's verdict lines as `distlab grade` computes them (without its sandbox): every rank's inputs drawn
    from a fresh secret seed and carried as safetensors, the reference computed from them here, each rank given
    only its own."""
    from distlab.checks import lab_module
    from distlab.checks.task import validate
    from distlab.engine.launch import launch
    from distlab.grading import secret
    def on_rank(task, case, answers, drawn):     # nested: travels by value (a rank imports no test module)
        import distlab
        return task.exercise(case, *answers, inputs=drawn[distlab.rank()])

    t = lab_module(lab).TASKS[task]
    case = t.cases()[case_index]
    drawn = [secret.load(secret.blob(d)) for d in secret.draw(t, case)]
    outputs = launch(on_rank, case.world_size, args=(t, case, tuple(getattr(ns, a) for a in t.answers), drawn), stall=5)
    validate(outputs)
    return _lines(t.judge(case, outputs, t.reference(case, inputs=drawn)))


def test_graded_inputs_reach_each_stage_as_it_needs_them_and_the_solution_passes_on_them(no_orphans):
    import torch

    from distlab.checks.ch08 import TASKS
    from distlab.course.pipeline.stages import build_stage
    from distlab.grading import secret
    four = secret.draw(TASKS["forward"], TASKS["forward"].cases()[1])        # 4 stages
    assert ["x" in d for d in four] == [True, False, False, False] and ["y" in d for d in four] == [False] * 3 + [True]
    for r, mine in enumerate(four):         # only its own stage's weights
        stage = build_stage("tiny", r, 4, n_layers=4, device="cpu")
        assert set(mine) - {"x", "y"} == {f"w.{n}" for n, _ in stage.named_parameters()}, r
    assert not torch.equal(four[1]["w.blocks.0.fc.weight"], four[2]["w.blocks.0.fc.weight"])   # blocks 1 and 2
    ns = answers(LAB)
    for task in ("forward", "1f1b", "offload_step"):
        out = graded_lines(task, ns)
        assert all(line.startswith("PASS") for line in out), out


def test_a_forward_rebuilt_from_the_package_s_seeds_fails_values_under_grading(no_orphans):
    # right logits in the notebook (test_a_forward_without_a_pipeline_fails_messages); drawn weights and tokens here
    out = graded_lines("forward", answers(LAB, replace={"pipeline_forward": LOCAL_FORWARD}))
    assert out[0].startswith("FAIL forward, 2 stages, m=2, values: max |the last rank's logits - reference|"), out


def test_the_stubs_fail_every_line(no_orphans):
    # (tests/test_labs.py runs the whole unfilled lab; here, the verdict text.)
    from distlab.checks.ch08 import TASKS
    stub = answers(LAB, stub=True)
    for name in ("forward", "offload_state"):
        out = _lines(run(LAB, name, stub))
        assert len(out) == len(TASKS[name].lines())
        assert all(l.startswith("FAIL") and l.endswith(("not implemented yet (NotImplementedError on a rank)",
                                                          "not implemented yet (not run: an earlier case raised "
                                                          "NotImplementedError)")) for l in out), out
        assert out[0].endswith("(NotImplementedError on a rank)"), out   # the first case ran; later ones would say the same


def test_gpipe_is_not_1f1b(no_orphans):
    out = _first_case("1f1b", answers(LAB, replace={"one_f_one_b_step": GPIPE_AS_1F1B}))
    by = {l.split(":")[0]: l for l in out}
    assert len(out) == 3, out
    assert by["PASS 1f1b, 2 stages, m=4, values"]
    assert by["PASS 1f1b, 2 stages, m=4, messages"]
    assert "FAIL 1f1b, 2 stages, m=4, activations" in by
    assert by["FAIL 1f1b, 2 stages, m=4, activations"].endswith(
        "1f1b holds at most 2: start each backward as soon as its gradient can arrive")


def test_a_forward_without_a_pipeline_fails_messages(no_orphans):
    out = _first_case("forward", answers(LAB, replace={"pipeline_forward": LOCAL_FORWARD}))
    assert out[0].startswith("PASS forward, 2 stages, m=2, values")
    assert out[1] == ("FAIL forward, 2 stages, m=2, messages: rank 0 posted 0 sends and 0 receives; "
                      "expected 2 and 0 (one message per micro-batch and direction)")


def test_unscaled_losses_fail_values_with_a_hint(no_orphans):
    out = _first_case("gpipe", answers(LAB, replace={"stage_loss": UNSCALED}))
    assert out[0].startswith("FAIL gpipe, 2 stages, m=4, values: max |the last rank's loss - reference|")
    assert out[2].startswith("PASS gpipe, 2 stages, m=4, messages")


def test_a_missing_send_is_reported_in_seconds(no_orphans, short_stall):
    start = time.monotonic()
    out = _lines(run(LAB, "gpipe", answers(LAB, replace={"p2p": DEADLOCK})))
    assert time.monotonic() - start < 60
    assert out[0].startswith(f"FAIL gpipe, 2 stages, m=4, values: hung: rank(s) [0] waited {short_stall} s")
    assert "(case: gpipe, 2 stages, m=4)" in out[0] and "every recv needs a send" in out[0]
    assert out[3:] == [f"FAIL gpipe, 4 stages, m=6, {k}: not run: an earlier case (2 ranks) hung"
                       for k in ("values", "activations", "messages")]


def test_offload_rejects_a_device_optimizer_late_gradients_and_wrong_arithmetic(no_orphans):
    plain = answers(LAB, replace={"OffloadAdam": NOT_OFFLOADED})
    out = _lines(run(LAB, "offload_state", plain))
    assert out[0].startswith("FAIL offload_state, host: the optimizer keeps 0.0 bytes per parameter off the model")
    late = _lines(run(LAB, "offload_grads", answers(LAB, replace={"step": LATE_GRADS})))
    assert late[0].startswith("FAIL offload_grads, streamed: step 0: 0 bytes went device -> host")
    assert late[1].startswith("FAIL offload_grads, released: step 0: after the backward")
    decay = _lines(run(LAB, "offload_step", answers(LAB, replace={"NO_WD": NO_WEIGHT_DECAY})))
    assert decay[0].startswith("FAIL offload_step, values: max |parameter"), decay
    assert decay[1].startswith("PASS offload_step, traffic")
