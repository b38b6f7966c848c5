"""Every lab is generated from its solution, and fails exactly its graded checks.

- labs/NN_*.ipynb equals make_lab(solutions/NN_*.ipynb) (run `distlab build-labs` to refresh);
- the solution's committed check outputs are all PASS lines (nbval compares against them);
- executing the unfilled lab prints a FAIL line, and no PASS line, in every graded check cell.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from distlab.checks.labs import verdict_lines, CHECK_TAG, build_labs, expected_lines, is_check_cell, make_lab, strip_answers

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_strip_answers_keeps_signatures_and_stubs_bodies():
    src = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    assert strip_answers(src) == "def f(x):\n    '''doc'''\n    raise NotImplementedError(\"your code here\")"
    with pytest.raises(ValueError):
        strip_answers("### BEGIN SOLUTION\nx = 1\n")


def test_labs_are_in_sync_with_solutions():
    stale, _ = build_labs(ROOT, check=True)
    assert not stale, f"run `distlab build-labs` to regenerate: {[str(p) for p in stale]}"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_check_outputs_all_pass(solution):
    nb = nbformat.read(solution, as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and is_check_cell(c)]
    assert checks, f"{solution.name} has no graded check cell"
    for cell in checks:
        text = _stdout(cell)
        lines = verdict_lines(cell)
        assert lines, f"check cell without committed verdict in {solution.name}:\n{cell.source}"
        bad = [l for l in lines if not l.startswith("PASS ")]
        assert not bad, f"{solution.name}: committed check output is not all PASS: {bad}"
        # the table above the lines (verdict_text): no FAIL, no case left unrun
        table = [l for l in text.splitlines() if l.strip() and not l.startswith(("PASS ", "FAIL "))]
        assert not any(w in l.split() for l in table for w in ("FAIL", "-")), (solution.name, table)


def _check_calls(nb) -> list[tuple[str, list[str]]]:
    """(task name, answer names) of every `grade("task", answer, ...)` check cell, in order."""
    import ast
    calls = []
    for cell in nb.cells:
        if cell.cell_type != "code" or not is_check_cell(cell):
            continue
        body = [n for n in ast.parse(cell.source).body if isinstance(n, ast.Expr)]
        assert len(body) == 1 and isinstance(body[0].value, ast.Call) and getattr(body[0].value.func, "id", "") == "grade", \
            f"a check cell must be one grade(...) call:\n{cell.source}"
        args = body[0].value.args
        calls.append((args[0].value, [a.id for a in args[1:]]))
    return calls


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_check_cells_are_one_line_and_name_the_labs_tasks(solution):
    from distlab.checks import lab_module
    nb = nbformat.read(solution, as_version=4)
    module = lab_module(solution.stem)
    calls = _check_calls(nb)
    assert [t for t, _ in calls] == list(module.TASKS), "every task graded once, in the module's order"
    for task, names in calls:
        assert tuple(names) == module.TASKS[task].answers, (task, names)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    assert module.PRELUDE in setup.source, "the lab's setup cell holds the check module's PRELUDE verbatim"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_unfilled_lab_fails_every_graded_line(solution, no_orphans, monkeypatch):
    """The stubs (answers replaced by NotImplementedError), run on ranks as the grader runs them: every line
    FAILs, and fails because a stub raised (its first case's lines say "not implemented yet", the later cases'
    that they were not run for that reason), not for any other cause.

    The cases' references are not computed here: a stub raises before anything is judged, so no reference is
    ever read (the reason asserted proves it), and the tests of the chapters' checks and of grading compute
    every reference against the solutions. The work cap is then its floor, LIVELOCK_FLOOR_S of CPU."""
    from labkit import answers, run
    from distlab.checks import lab_module
    from distlab.checks import task as task_mod
    monkeypatch.setattr(task_mod, "_reference", lambda task, case: (None, 0.0))
    stubs = answers(solution.stem, stub=True)
    for task in lab_module(solution.stem).TASKS:
        lines = run(solution.stem, task, stubs)
        assert lines and not any(line.ok for line in lines), [str(line) for line in lines if line.ok]
        assert lines[0].detail.startswith(task_mod.NOT_WRITTEN), (task, str(lines[0]))
        assert all(line.detail.startswith(task_mod.NOT_WRITTEN) for line in lines), (task, [str(l) for l in lines])


def test_a_lab_shows_no_verdict_and_nbval_reads_the_expected_lines(tmp_path, capsys, monkeypatch):
    """A lab opens without verdicts; `pytest --nbval-lax` passes once the stubs are filled in, not before."""
    import copy

    from nbformat.v4 import new_code_cell, new_notebook, new_output
    answer = "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"
    check_src = "from distlab.checks import check, expect\n_ = check('double', lambda: expect(double(2) == 4, 'no'))"
    solution = new_notebook(cells=[new_code_cell(answer), new_code_cell(check_src, metadata={"tags": [CHECK_TAG]})],
                            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    # The solution as committed: its check's output (the nbval run below shows the check prints exactly this)
    solution.cells[1].outputs = [new_output("stream", name="stdout", text="PASS double\n")]
    lab = make_lab(solution)
    assert "NotImplementedError" in lab.cells[0].source
    assert all(not c.outputs and c.execution_count is None for c in lab.cells)   # nothing to see yet
    assert expected_lines(lab.cells[1]) == ["PASS double"]

    # One nbval run (one interpreter) over both notebooks: the unfilled lab and the learner's.
    nbformat.write(lab, tmp_path / "unfinished.ipynb")
    filled = nbformat.from_dict(copy.deepcopy(lab))
    filled.cells[0].source = "def double(x):\n    return x + x"  # the learner's answer
    nbformat.write(filled, tmp_path / "finished.ipynb")
    # pytest in this process, as a learner's `pytest --nbval-lax` would run (a new session, the plugins found by
    # their entry points: nbval and distlab's); a subprocess would only import torch and pytest's plugins again.
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        code = pytest.main(["--nbval-lax", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
                            "-o", "addopts=", "--rootdir", str(tmp_path), "unfinished.ipynb", "finished.ipynb"])
    out = capsys.readouterr().out
    assert code == 1 and "Cell outputs differ" in out, out[-3000:]
    assert "FAILED unfinished.ipynb::Cell 1" in out, out[-3000:]                 # the check, before the answer
    assert "PASSED finished.ipynb::Cell 1" in out and "FAILED finished.ipynb" not in out, out[-6000:]


def test_a_kernel_that_dies_at_start_is_started_again_with_its_words():
    """nbval's kernel start, wrapped by distlab's plugin: a kernel that exits before replying is retried."""
    from distlab.apps.nbval_plugin import retrying
    calls = []

    def start(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            kwargs["stderr"].write(b"zmq.error.ZMQError: Address already in use\n")
            kwargs["stderr"].flush()
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "km", "kc"

    with pytest.warns(RuntimeWarning) as said:
        assert retrying(start)(kernel_name="python3", stderr=None) == ("km", "kc")
    assert len(calls) == 3 and all(c["kernel_name"] == "python3" for c in calls)
    texts = [str(w.message) for w in said]
    assert len(texts) == 2 and all(t.startswith("distlab: a notebook kernel exited before it replied") for t in texts)
    assert "(try 1 of 3); it said: zmq.error.ZMQError: Address already in use" in texts[0]

    def never(**kwargs):
        raise RuntimeError("Kernel died before replying to kernel_info")
    with pytest.raises(RuntimeError, match="died"), pytest.warns(RuntimeWarning):
        retrying(never, tries=2)()

    def other(**kwargs):          # any other failure is nbval's to report, at once
        calls.append(1)
        raise RuntimeError("Kernel didn't respond in 60 seconds")
    calls.clear()
    with pytest.raises(RuntimeError, match="respond"):
        retrying(other)()
    assert calls == [1]
