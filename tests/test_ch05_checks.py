"""Chapter 5's graded checks under grading's drawn inputs (the notebook's checks: tests/test_ch05_zero3.py)."""
from __future__ import annotations

from distlab.checks import run_task
from distlab.checks.ch05 import TASKS
from labkit import answers, only
from test_ch08_checks import graded_lines

LAB = "05_zero3"

# A forward that ignores the shards: the whole model rebuilt from the package's seed on every rank, nothing
# gathered. Right logits in the notebook (every rank starts from that model there).
LOCAL_FORWARD = '''
from distlab.course.models import build_model as _build
class ZeRO3(ZeRO3):
    def forward(self, *args, **kwargs):
        return _build("tiny")(*args, **kwargs)
'''


def test_a_forward_rebuilt_from_the_package_s_seed_fails_values_under_grading(no_orphans):
    ns = answers(LAB, replace={"ZeRO3": LOCAL_FORWARD})
    task = only(TASKS["forward"], 2)
    mine = [str(line) for line in run_task(task, [ns.ZeRO3])]
    assert mine[0].startswith("PASS forward, 2 ranks: the same logits as one process"), mine
    assert mine[1].startswith("FAIL forward, 2 ranks: one all-gather per unit"), mine
    # under grading every rank starts from its own drawn weights: the logits are rank 0's model's, gathered
    graded = graded_lines("forward", ns, lab=LAB)
    assert graded[0].startswith("FAIL forward, 2 ranks: the same logits as one process: max |rank "), graded
    assert graded[1].startswith("FAIL forward, 2 ranks: one all-gather per unit"), graded
