"""Lab 8's 2 x 2 x 2 step (pp, dp, tp): plausible mistakes fail the lines that should catch them.

The solution passes every line in solutions/08 (nbval) and the stubs fail them (tests/test_labs.py); here,
two answers that run the pipeline right but average the gradients wrongly. Each is one 8-rank launch."""
from __future__ import annotations

from labkit import answers, run

LAB = "08_pipeline"

# The gradients averaged in the wrong group (tp instead of dp): the tp partner's different slice is mixed
# in, the dp replicas never meet, and the tp group carries traffic the blocks did not make.
TP_AVERAGE = '''
def step_3d(stage, groups, x, y, m, micro_batch):
    loss = pipeline_1f1b(stage, x, y, m, micro_batch, dist.get_process_group_ranks(groups["pp"]))
    for q in stage.parameters():
        dist.all_reduce(q.grad, group=groups["tp"])
        q.grad /= groups["tp"].size()
    return loss
'''
# The dp replicas' gradients summed, not averaged: the traffic is right, the values twice too large.
DP_SUM = '''
def step_3d(stage, groups, x, y, m, micro_batch):
    loss = pipeline_1f1b(stage, x, y, m, micro_batch, dist.get_process_group_ranks(groups["pp"]))
    for q in stage.parameters():
        dist.all_reduce(q.grad, group=groups["dp"])
    return loss
'''
HEAD = "step_3d, (pp, dp, tp) = (2, 2, 2), m=2"


def _by_line(ns):
    return {str(line).split(":")[0].split(", ")[-1]: str(line) for line in run(LAB, "step_3d", ns)}


def test_averaging_in_the_tp_group_fails_values_dp_and_tp(no_orphans):
    out = _by_line(answers(LAB, replace={"step_3d": TP_AVERAGE}))
    assert out["values"].startswith(f"FAIL {HEAD}, values: max |rank "), out
    assert "the mean over the dp replicas" in out["values"], out
    assert out["dp"].startswith(f"FAIL {HEAD}, dp: rank 0 sent 0 bytes in its dp group"), out
    assert out["tp"].startswith(f"FAIL {HEAD}, tp: rank 0 sent "), out
    assert out["pp"].startswith(f"PASS {HEAD}, pp"), out


def test_summing_over_dp_fails_values_only(no_orphans):
    out = _by_line(answers(LAB, replace={"step_3d": DP_SUM}))
    assert out["values"].startswith(f"FAIL {HEAD}, values: max |rank "), out
    assert [out[k][:4] for k in ("pp", "dp", "tp")] == ["PASS"] * 3, out


def test_under_grading_each_rank_gets_its_stage_and_replica_and_the_solution_passes(no_orphans):
    # drawn weights and batch (distlab grade's inputs): a rank's coordinate decides what it receives
    from test_ch08_checks import graded_lines
    out = graded_lines("step_3d", answers(LAB))
    assert [line[:4] for line in out] == ["PASS"] * 4, out
