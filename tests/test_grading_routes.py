"""Issue 38's routes that need a sandboxed grading run: the package's own answers to a lab are out of a
submission's reach (lab 08's schedule tables are `simulate`'s order functions). One hand-in, the two table tasks'
smaller cases, one rank each."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from distlab.grading import sandbox
from distlab.grading.cli import sandbox_for
from distlab.grading.classrun import grade
from distlab.grading.grade import Options, prepare

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_class", ROOT / "tests/fixtures/grading/make_class.py")
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)
pytestmark = pytest.mark.timeout(900)
BWRAP = sandbox.bwrap_path() is not None and (sandbox.works(True) or sandbox.works(False))

PACKAGE_ANSWERS = '''
from distlab.course.pipeline import simulate as _s
import importlib
_s = importlib.reload(_s)                   # a fresh copy of the module, from its file
interleaved_schedule = _s.interleaved_order
zero_bubble_schedule = _s.zero_bubble_order
'''


@pytest.mark.skipif(not BWRAP, reason="bubblewrap is not usable here (the package's files are hidden by the sandbox)")
def test_lab8s_answers_in_the_package_are_out_of_a_submission_s_reach(tmp_path):
    lab = mk.shipped("08_pipeline")
    good = mk.solution_answers("08_pipeline")
    table_cell = next(k for k, v in good.items() if "def zero_bubble_schedule" in v)     # after the interleaved one
    path = mk.write({"package": mk.submission(lab, dict(good, **{table_cell: good[table_cell] + PACKAGE_ANSWERS}))},
                    tmp_path / "handins")["package"]
    shipped = prepare("08_pipeline", ["interleaved, p=2", "zero_bubble, p=2"])
    (package,) = grade(shipped, [path], opts=Options(sandbox=sandbox_for(False, lambda text: None)))
    # it scored 7/7 before (issue 38); the honest solution's marks under the same sandbox: test_grading_class
    assert package.score == 0 and package.max_score == 7, [(v.check, v.reason) for v in package.verdicts]
    assert all("not implemented yet" in v.reason for v in package.verdicts), [v.reason for v in package.verdicts]
