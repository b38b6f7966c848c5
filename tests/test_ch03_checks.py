"""Chapter 3's graded checks catch wrong, cheating and hanging answers, not only missing ones.

To stay fast, most tests run one case of a task (`labkit.only`).
"""
from __future__ import annotations

import time

import torch

from distlab.checks.ch03 import TASKS
from labkit import answer_sources, answers, only, task_lines as _lines

LAB = "03_zero1"


# The stubs failing every line is tests/test_labs.py::test_unfilled_lab_fails_every_graded_line (every lab).


# The solution passing every line is solutions/03_zero1.ipynb under nbval (every case of every check cell against
# its committed PASS lines) and tests/test_grading_class.py (graded as a learner's submission, sandboxed).


# Every rank builds the inner optimizer on all the parameters: nothing is sharded.
UNSHARDED = '''
class ShardedOptimizer(ShardedOptimizer):
    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.pieces = [torch.nn.Parameter(t, requires_grad=False) for t in self.flat_param.split(self.PIECE)]
        self.optim = optimizer_class(self.pieces, **defaults)
        self.state = self.optim.state
'''


def test_an_optimizer_on_every_parameter_fails_the_shard_line(no_orphans):
    out = _lines(only(TASKS["init"]), answers(LAB, replace={"ShardedOptimizer": UNSHARDED}))
    assert out[0].startswith("PASS") and out[1].startswith("PASS"), out
    assert out[2].startswith("FAIL ShardedOptimizer.__init__, 2 ranks: the inner optimizer holds this rank's shard "
                             "only: frozen weights, rank 0: the inner optimizer holds 33664 elements, expected 16832"), out


# No broadcast: rank 0's weights rebuilt from the package's seed (100 + rank in the notebook's check). Right
# weights in the notebook; the weights judged must come from the metered construction's broadcast.
REBUILT_START = ("        dist.broadcast(self.flat_param, src=0)\n", '''\
        from distlab.course.data_parallel.reference import make_model, trainable
        for v in ("frozen", "tied"):
            mine = [q for _, q in trainable(make_model(v, dtype=first.dtype, seed=100 + self.rank))]
            if len(mine) == len(self.params) and all(torch.equal(a, b) for a, b in zip(mine, self.params)):
                zero = [q for _, q in trainable(make_model(v, dtype=first.dtype, seed=100))]
                self.flat_param[:numel].copy_(torch.cat([q.detach().reshape(-1) for q in zero]))
''')


def test_rank_0_s_weights_rebuilt_without_a_broadcast_fail_the_start_line(no_orphans):
    src = answer_sources(LAB)[0]
    assert REBUILT_START[0] in src, "the solution changed: update this test"
    out = _lines(only(TASKS["init"]), answers(LAB, replace={"ShardedOptimizer": src.replace(*REBUILT_START)}))
    assert out[0].startswith("PASS") and out[2].startswith("PASS"), out
    assert out[1] == ("FAIL ShardedOptimizer.__init__, 2 ranks: starts from rank 0's weights: frozen weights, rank 0: "
                      "construction called nothing; expected broadcast only (rank 0's weights to every rank)"), out   # values matched


# Buffers made without device=: on a GPU they would be CPU tensors; the audit refuses them at the broadcast.
HOST_BUFFERS = '''
class ShardedOptimizer(ShardedOptimizer):
    def __init__(self, params, optimizer_class, **defaults):
        torch.optim.Optimizer.__init__(self, list(params), defaults)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in self.param_groups[0]["params"] if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-numel // self.world)
        self.flat_param = torch.zeros(self.shard_numel * self.world, dtype=self.params[0].dtype)
        dist.broadcast(self.flat_param, src=0)
'''


def test_a_buffer_made_without_a_device_is_caught_by_the_audit(no_orphans):
    out = _lines(only(TASKS["init"]), answers(LAB, replace={"ShardedOptimizer": HOST_BUFFERS}))
    assert all("raised DeviceAuditError: device audit:" in line and "created without a device" in line
               for line in out), out


NO_MEAN = '''
@add_to_class(ShardedOptimizer)
def _reduce_scatter_grad(self):
    grad = torch.empty_like(self.shard)
    dist.reduce_scatter(grad, list(self.flat_grad.chunk(self.world)))
    return grad                                  # the sum, not the mean
'''
ALL_REDUCE_AND_SLICE = '''
@add_to_class(ShardedOptimizer)
def _reduce_scatter_grad(self):
    total = self.flat_grad.clone()
    dist.all_reduce(total)                       # right values, twice the bytes
    k = self.shard_numel
    return total[self.rank * k:(self.rank + 1) * k] / self.world
'''


def test_the_reduce_scatter_catches_a_sum_and_an_all_reduce(no_orphans):
    out = _lines(only(TASKS["reduce_scatter_grad"]), answers(LAB, replace={"r": NO_MEAN}))
    assert out[0].startswith("FAIL _reduce_scatter_grad, 2 ranks, values: max |frozen weights, rank 0's gradient "
                             "shard - reference|"), out
    assert out[1].startswith("PASS"), out
    out = _lines(only(TASKS["reduce_scatter_grad"]), answers(LAB, replace={"r": ALL_REDUCE_AND_SLICE}))
    assert out[0].startswith("PASS"), out
    assert out[1] == ("FAIL _reduce_scatter_grad, 2 ranks, traffic: rank 0 called all_reduce: expected only "
                      "reduce_scatter"), out


# The all-gather done with one broadcast per rank: right values, N x S instead of (N-1)/N x S per rank.
BROADCASTS = '''
@add_to_class(ShardedOptimizer)
def _all_gather_params(self):
    for r, piece in enumerate(self.flat_param.chunk(self.world)):
        dist.broadcast(piece, src=r)
'''


def test_an_all_gather_by_broadcasts_fails_the_traffic_line(no_orphans):
    out = _lines(only(TASKS["all_gather_params"]), answers(LAB, replace={"a": BROADCASTS}))
    assert out[0].startswith("PASS"), out
    assert out[1] == ("FAIL _all_gather_params, 2 ranks, traffic: rank 0 called broadcast: expected only "
                      "all_gather"), out


NO_ALL_GATHER = '''
@add_to_class(ShardedOptimizer)
def _all_gather_params(self):
    pass                                         # every rank keeps only its own shard's update
'''


def test_a_step_without_the_all_gather_fails_values_and_traffic(no_orphans):
    out = _lines(only(TASKS["step"]), answers(LAB, replace={"a": NO_ALL_GATHER}))
    assert [line.split(":")[0] for line in out if line.startswith("PASS")] == [
        "PASS ShardedOptimizer, 2 ranks, frozen weights", "PASS ShardedOptimizer, 2 ranks, tied weights"], out
    assert out[-1] == ("FAIL ShardedOptimizer, 2 ranks: collectives and bytes: rank 0: 1 reduce-scatters and "
                       "0 all-gathers; expected the same number of each (one per flat buffer)"), out


# An honest first step, then an all-reduce of the whole gradient (twice the bytes): right values all along.
LATER_ALL_REDUCE = '''
_honest = ShardedOptimizer._reduce_scatter_grad
@add_to_class(ShardedOptimizer)
def _reduce_scatter_grad(self):
    self.calls = getattr(self, "calls", 0) + 1
    if self.calls == 1:
        return _honest(self)
    dist.all_reduce(self.flat_grad)
    return self.flat_grad[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel] / self.world
'''


def test_every_step_s_traffic_is_judged_not_only_the_first(no_orphans):
    out = _lines(only(TASKS["step"]), answers(LAB, replace={"a": LATER_ALL_REDUCE}))
    assert all(line.startswith("PASS") for line in out[:-1]), out
    assert out[-1] == ("FAIL ShardedOptimizer, 2 ranks: collectives and bytes: rank 0: unexpected collectives in a "
                       "step (step 1): {'all_reduce': 1}"), out


# Rank 0 skips the all-gather of the first step: rank 1 waits for it forever.
DEADLOCK = '''
@add_to_class(ShardedOptimizer)
def _all_gather_params(self):
    if dist.get_rank() != 0:
        all_gather_tensor(self.flat_param, self.shard.clone())
'''


def test_a_hang_is_reported_in_seconds_with_its_case_and_a_hint(no_orphans, short_stall):
    start = time.monotonic()
    out = _lines(TASKS["step"], answers(LAB, replace={"a": DEADLOCK}))
    assert time.monotonic() - start < 60
    assert out[0].startswith("FAIL ShardedOptimizer(SGD), 2 ranks, frozen weights: hung: rank(s) [")
    assert "(case: ShardedOptimizer(SGD), 2 ranks, frozen weights, step " in out[0]
    assert "every rank must call the reduce-scatter and the all-gather" in out[0]
    n2 = len(TASKS["step"].cases()[0].lines)
    assert all("hung: rank(s)" in line for line in out[:n2]), out
    assert all(line.endswith("not run: an earlier case (2 ranks) hung") for line in out[n2:]), out


def test_the_lab_holds_the_prelude_one_line_checks_and_its_expected_time():
    import nbformat

    from distlab.checks.ch03 import PRELUDE
    from distlab.checks.labs import is_check_cell
    from labkit import ROOT
    nb = nbformat.read(ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert PRELUDE in code[0].source
    checks = [c for c in code if is_check_cell(c)]
    assert [[line for line in c.source.splitlines() if not line.startswith("#")] for c in checks] == [
        [f'grade("{name}", {", ".join(task.answers)})'] for name, task in TASKS.items()]
    assert "*Expected time:" in nb.cells[0].source


# Every rank's shard rebuilt from the package's pattern (what the notebook's check writes into each shard), nothing
# gathered: right parameters in the notebook.
PREDICTED_GATHER = '''
from distlab.checks.ch03 import _pattern
@add_to_class(ShardedOptimizer)
def _all_gather_params(self):
    k = self.shard_numel
    with torch.no_grad():
        for r in range(self.world):
            self.flat_param[r * k:(r + 1) * k].copy_(_pattern(r, k, self.flat_param.dtype))
'''


def test_shards_rebuilt_from_the_package_s_pattern_fail_values_under_grading(no_orphans):
    from test_ch08_checks import graded_lines
    ns = answers(LAB, replace={"a": PREDICTED_GATHER})
    mine = _lines(only(TASKS["all_gather_params"]), ns)
    assert mine[0].startswith("PASS _all_gather_params, 2 ranks, values"), mine
    assert mine[1] == "FAIL _all_gather_params, 2 ranks, traffic: rank 0 issued no all-gather", mine
    graded = graded_lines("all_gather_params", ns, lab=LAB)     # each rank's shard drawn: only it holds it
    assert graded[0].startswith("FAIL _all_gather_params, 2 ranks, values: max |frozen weights, rank 0's "), graded
    assert graded[1] == mine[1], graded


# ---- the fp16 loss scaler (ch03_scaler) ------------------------------------------------------------------
# The wrong scalers below make no collective, so each rank's exercise runs here, in this process, one rank after
# the other (no launch: no seconds); the judge is the one the notebook and the grader call. The right scaler
# (all-reduce included) passes in solutions/03_zero1.ipynb under nbval and under grading.

class LocalScaler:
    """A scaler that decides on its own rank's gradients; each keyword breaks one more thing."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, *,
                 bad=torch.isfinite, unscale=True, skip=True, grow=True, back_off=True):
        self.s, self.up, self.down, self.every, self.good, self.found = (
            init_scale, growth_factor, backoff_factor, growth_interval, 0, False)
        self.ok, self.unscale, self.skip, self.grow, self.back_off = bad, unscale, skip, grow, back_off

    def scale(self, loss):
        return loss * self.s

    def get_scale(self):
        return self.s

    @torch.no_grad()
    def step(self, opt):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            if self.unscale:
                g.div_(self.s)
        self.found = not all(bool(self.ok(g).all()) for g in grads)
        if not (self.found and self.skip):
            opt.step()

    def update(self):
        self.good = 0 if self.found else self.good + 1
        if self.found and self.back_off:
            self.s *= self.down
        elif not self.found and self.good == self.every:
            self.s, self.good = self.s * (self.up if self.grow else 1.0), 0


def _scaler_lines(monkeypatch, **broken) -> list[str]:
    """The scaler task's verdict lines for LocalScaler(**broken), each rank exercised in this process."""
    import functools

    import distlab
    from distlab.checks.task import validate
    task = TASKS["loss_scaler"]
    case = task.cases()[0]
    monkeypatch.setattr(distlab, "device", lambda: torch.device("cpu"))
    outputs = []
    for r in range(case.world_size):
        monkeypatch.setattr(distlab, "rank", lambda r=r: r)
        outputs.append(task.exercise(case, functools.partial(LocalScaler, **broken)))
    validate(outputs)
    return [str(line) for line in task.judge(case, outputs, task.reference(case))]


def test_a_scaler_that_decides_alone_fails_only_the_ranks_agree_line(monkeypatch):
    skip, scale, agree = _scaler_lines(monkeypatch)
    assert skip.startswith("PASS") and scale.startswith("PASS"), (skip, scale)
    assert agree.startswith("FAIL LossScaler, 2 ranks: every rank skips the same steps, with the same scale: "
                            "step "), agree
    assert "stepped anyway: all-reduce the found-inf flag (MAX, or SUM) across the ranks" in agree, agree


def test_the_scaler_s_verdicts_name_the_step_and_what_to_fix(monkeypatch):
    line = _scaler_lines(monkeypatch, skip=False)[0]
    assert line.startswith("FAIL") and "but the weights changed: skip optimizer.step() when any gradient is not " \
        "finite" in line, line
    line = _scaler_lines(monkeypatch, bad=lambda g: ~torch.isinf(g))[0]      # isinf only: the nan goes through
    assert line.startswith("FAIL") and "the gradient held a nan but the weights changed" in line, line
    line = _scaler_lines(monkeypatch, unscale=False)[0]
    assert line == ("FAIL LossScaler, 2 ranks: overflowing steps skipped, the others unscaled and taken: step 0 "
                    "(scale 8192), rank 0: the weights moved 8192x too far: divide the gradients by the scale "
                    "(unscale) before optimizer.step()"), line
    line = _scaler_lines(monkeypatch, grow=False)[1]
    assert line.startswith("FAIL LossScaler, 2 ranks: the scale backs off on overflow and grows after good steps: "
                           "rank 0, step 1: the scale went 8192 -> 8192 after 2 good step(s) in a row; expected "
                           "16384"), line
    line = _scaler_lines(monkeypatch, back_off=False)[1]
    assert "the step overflowed" in line and "expected x backoff_factor" in line, line


def test_the_scaler_s_secret_inputs_put_each_spike_on_one_rank(monkeypatch):
    from distlab.checks import ch03_scaler as sc
    from distlab.grading import secret
    task = TASKS["loss_scaler"]
    case = task.cases()[0]
    drawn = secret.draw(task, case)
    assert len(drawn) == 2 and drawn[0]["x"].dtype == torch.float16 and drawn[0]["x"].shape == (sc.STEPS, sc.K)
    big = [(r, t) for r in range(2) for t in range(sc.STEPS) if (drawn[r]["x"][t].float().abs() > 100).any()]
    nan = [(r, t) for r in range(2) for t in range(sc.STEPS) if drawn[r]["x"][t].isnan().any()]
    assert len(big) == 1 and len(nan) == 1 and big[0][1] != nan[0][1] and 1 <= big[0][1] <= 7, (big, nan)
    assert not torch.equal(drawn[0]["x"], sc.draw(torch.Generator().manual_seed(sc.SEED), 2)[0]["x"])
