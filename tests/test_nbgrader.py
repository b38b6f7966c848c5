"""The labs as nbgrader assignments (`distlab.apps.nbgrader_course`): nbgrader's release of a converted
solution has the cells `distlab build-labs` writes, and `nbgrader autograde` gives each check cell the points
its verdict lines passed, as `distlab grade` counts them.

nbgrader runs in this process through its own API (`NbGraderAPI`, what its `generate_assignment` and
`autograde` commands run), with the course's `nbgrader_config.py`: a second interpreter would only import
nbgrader again. Lab 01 is the cheapest lab to run. One hand-in (one kernel) covers both ends: the solution's
answer to task 1 (full points) and tasks 2 to 4 left as released (0 points each). `distlab grade` gives
that hand-in 6/24 as well (6 per task, 1 per verdict line); the whole solution 24/24 and the
unfilled lab 0/24 under both (README, *Labs as nbgrader assignments*).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

from nbgrader.apps import api as nbgrader_api     # the `nbgrader` extra, part of `dev`

from distlab.apps.nbgrader_course import STUB, write_course
from distlab.checks import lab_module
from distlab.checks.labs import make_lab

# nbgrader 0.9.6's gradebook trips SQLAlchemy 2's autoflush warnings; they say nothing about the labs.
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

ROOT = Path(__file__).resolve().parents[1]
LAB = "01_collectives"
FILLED = ("reduce_scatter",)     # the task whose answer the hand-in gives (one: each answered task launches ranks)


def _cells(nb):
    """What a learner sees of each cell: type, source, tags and distlab's metadata (expected verdicts)."""
    return [(c.cell_type, c.source, c.metadata.get("tags", []), c.metadata.get("distlab", {})) for c in nb.cells]


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course folder holding lab 01's source, and nbgrader's API configured from its nbgrader_config.py."""
    from traitlets.config.loader import PyFileConfigLoader
    course = tmp_path / "course"
    written = write_course(course, [LAB])
    assert written == [course / "source" / LAB / f"{LAB}.ipynb"]
    # nbgrader's gradebook runs the `alembic` command: the environment's bin/ must be on PATH.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DISTLAB_QUICK", "1")
    monkeypatch.chdir(course)
    config = PyFileConfigLoader("nbgrader_config.py", str(course)).load_config()
    config.CourseDirectory.root = str(course)
    return course, nbgrader_api.NbGraderAPI(config=config)


def test_release_equals_the_lab_and_autograde_scores_as_distlab_grade(course):
    course, api = course
    done = api.generate_assignment(LAB)
    assert done["success"], done["log"] + done["error"]
    release = nbformat.read(course / "release" / LAB / f"{LAB}.ipynb", as_version=4)
    lab = make_lab(nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4))   # what build-labs writes
    assert _cells(release) == _cells(lab)
    assert not any(c.get("outputs") for c in release.cells if c.cell_type == "code")

    # The hand-in: the released notebook with the solution's answer to task 1 typed in.
    source = nbformat.read(course / "source" / LAB / f"{LAB}.ipynb", as_version=4)
    tasks = lab_module(LAB).TASKS
    handin = nbformat.read(course / "release" / LAB / f"{LAB}.ipynb", as_version=4)
    for cell, answer in zip(handin.cells, source.cells):
        if answer.metadata["nbgrader"]["solution"] and any(
                f"def {name}(" in answer.source for t in FILLED for name in tasks[t].answers):
            assert STUB in cell.source
            cell.source = answer.source
    target = course / "submitted" / "student" / LAB / f"{LAB}.ipynb"
    target.parent.mkdir(parents=True)
    nbformat.write(handin, target)

    done = api.autograde(LAB, "student")
    assert done["success"], done["log"] + done["error"]
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        got = {g.name: (g.auto_score, g.max_score) for g in gb.find_submission_notebook(LAB, LAB, "student").grades}
    # distlab grade's points: task.points per verdict line; a task passes every line or (unwritten) none
    most = {name: task.points * len(task.lines()) for name, task in tasks.items()}
    assert got == {name: (most[name] if name in FILLED else 0.0, most[name]) for name in tasks}
    assert sum(s for s, _ in got.values()) == 6.0


def test_every_lab_converts_to_its_lab_under_nbgrader_preprocessors(tmp_path):
    """Every lab (no kernel, no gradebook): nbgrader's own ClearSolutions and ClearHiddenTests, configured by the
    course's nbgrader_config.py, turn each source notebook into the cells build-labs writes; each check cell is
    worth its task's verdict lines, and every cell but the answers is locked."""
    from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions
    from traitlets.config.loader import PyFileConfigLoader
    from distlab.apps.cli import main
    assert main(["nbgrader-source", str(tmp_path / "one"), "--lab", "01_collectives"]) == 0     # the command
    assert [p.name for p in (tmp_path / "one" / "source").rglob("*.ipynb")] == ["01_collectives.ipynb"]
    written = write_course(tmp_path)
    assert sorted(p.stem for p in written) == sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    config = PyFileConfigLoader("nbgrader_config.py", str(tmp_path)).load_config()
    for path in written:
        source = nbformat.read(path, as_version=4)
        tasks = lab_module(path.stem).TASKS
        graded = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"]["points"]
                  for c in source.cells if c.metadata["nbgrader"]["grade"]}
        assert graded == {name: task.points * len(task.lines()) for name, task in tasks.items()
                          if name in graded} and graded, path.stem
        assert all(c.metadata["nbgrader"]["locked"] != c.metadata["nbgrader"]["solution"] for c in source.cells)
        released, resources = ClearSolutions(config=config).preprocess(source, {})
        released, _ = ClearHiddenTests(config=config).preprocess(released, resources)
        lab = make_lab(nbformat.read(ROOT / "solutions" / path.name, as_version=4))
        assert _cells(released) == _cells(lab), path.stem
