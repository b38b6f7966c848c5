"""Chapter 3's graded checks catch wrong, cheating and hanging answers, not only missing ones.

To stay fast, most tests run one case of a task (`labkit.only`).
"""
from __future__ import annotations

import time

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
        [f'grade("{name}", ShardedOptimizer)'] for name in TASKS]
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
