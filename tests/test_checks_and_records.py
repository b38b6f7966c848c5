"""Verdict lines, quick mode and result records behave as the notebooks rely on."""
import json

import pytest
import torch

import distlab
from distlab.checks import CheckFailed, check, compare, expect
from distlab.meters.records import load_records, record


def test_compare_exact_close_and_wrong():
    assert compare(torch.ones(3), torch.ones(3)) == "exact"
    assert compare(torch.ones(3), torch.ones(3) + 1e-6) == "close"
    with pytest.raises(CheckFailed, match=r"max \|mine - reference\| = 1.0e\+00"):
        compare(torch.ones(3), torch.zeros(3))
    with pytest.raises(CheckFailed, match="shape"):
        compare(torch.ones(3), torch.ones(4))
    with pytest.raises(CheckFailed, match="dtype"):
        compare(torch.ones(3), torch.ones(3, dtype=torch.float64))


def test_check_prints_one_verdict_line(capsys):
    assert check("adds up", lambda: compare(torch.tensor(2.0), torch.tensor(2.0))) is True
    assert check("not yet", lambda: (_ for _ in ()).throw(NotImplementedError())) is False
    assert check("wrong", lambda: expect(1 == 2, "1 is not 2")) is False
    assert capsys.readouterr().out.splitlines() == [
        "PASS adds up: exact", "FAIL not yet: not implemented yet (NotImplementedError)", "FAIL wrong: 1 is not 2"]


def _not_done():
    raise NotImplementedError("your code here")


def test_check_unwraps_a_failed_rank(capsys, no_orphans):
    assert check("on ranks", lambda: distlab.launch(_not_done, 2)) is False
    assert capsys.readouterr().out.strip().endswith(
        "FAIL on ranks: not implemented yet (NotImplementedError on a rank)")


def test_quick_mode_switch(monkeypatch):
    monkeypatch.setenv("DISTLAB_QUICK", "1")
    assert distlab.quick() and distlab.pick(quick=2, full=50) == 2
    monkeypatch.setenv("DISTLAB_QUICK", "0")
    assert not distlab.quick() and distlab.pick(quick=2, full=50) == 50


def test_records_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_RESULTS", str(tmp_path))
    rec = record("strategies", name="ddp", bytes=torch.tensor([1, 2]), nested={"a": 1.5})
    record("strategies", name="zero1")
    assert rec == {"name": "ddp", "bytes": [1, 2], "nested": {"a": 1.5}}
    loaded = load_records(tmp_path)
    assert [r["name"] for r in loaded["strategies"]] == ["ddp", "zero1"]
    assert json.loads((tmp_path / "strategies.jsonl").read_text().splitlines()[0])["bytes"] == [1, 2]
    with pytest.raises(ValueError, match="plain name"):
        record("../evil", x=1)


def _chatty():
    print(f"debug line from rank {distlab.rank()}")
    return distlab.rank()


def test_check_output_is_the_verdict_alone(capsys, no_orphans):
    assert check("quiet", lambda: str(distlab.launch(_chatty, 2)))
    assert capsys.readouterr().out == "PASS quiet: [0, 1]\n"


def test_a_stub_fails_every_line_and_only_its_first_case_runs():
    """An answer still raising NotImplementedError: one launch, every line FAILs, later cases are not run."""
    from distlab.checks.task import Case, Line, Task, run_task

    class Two(Task):
        name, answers = "two", ("f",)

        def cases(self):
            return [Case(n, (f"two, {n} ranks",)) for n in (2, 3, 4)]

        def reference(self, case):
            return None

        def judge(self, case, outputs, reference):
            return [Line(case.lines[0], True, "")]

    launched = []

    def run(task, case, answers):
        launched.append(case.world_size)
        return answers[0]()

    def stub():
        raise NotImplementedError("your code here")

    lines = run_task(Two(), [stub], run=run)
    assert launched == [2]
    assert [line.name for line in lines] == ["two, 2 ranks", "two, 3 ranks", "two, 4 ranks"]
    assert not any(line.ok for line in lines)
    assert lines[0].detail == "not implemented yet (NotImplementedError)"
    assert lines[1].detail == lines[2].detail == "not implemented yet (not run: an earlier case raised NotImplementedError)"
    # a written answer runs every case
    launched.clear()
    assert all(line.ok for line in run_task(Two(), [lambda: [1, 2]], run=run)) and launched == [2, 3, 4]


def _redefine(source: str, ns: dict) -> None:
    exec(compile(source, "<cell>", "exec"), ns)  # noqa: S102 - a notebook cell, re-run


def test_a_class_redefined_after_add_to_class_is_explained_by_grade_and_kept_by_restore(capsys):
    from distlab.checks.task import Case, Task, grader
    from distlab.course import stepwise
    ns = {"__name__": "lab_redefined", "add_to_class": distlab.add_to_class}
    step1 = "class Sharded:\n    def __init__(self):\n        self.n = 1\n"
    _redefine(step1, ns)
    _redefine("@add_to_class(Sharded)\ndef _on_grad(self):\n    return 2\n", ns)
    _redefine("@add_to_class(Sharded)\ndef step(self):\n    return 3\n", ns)
    _redefine(step1, ns)                   # the learner re-runs the class cell: a new class, no added methods
    cls = ns["Sharded"]
    assert stepwise.missing_methods(cls) == ["_on_grad", "step"]

    class OneCase(Task):
        name, answers = "step", ("Sharded",)

        def cases(self):
            return [Case(2, ("step, 2 ranks: values", "step, 2 ranks: traffic"))]

    grader({"step": OneCase()})("step", cls)          # nothing runs: the verdict says what happened
    lost = ("the class Sharded was redefined after the cells that add _on_grad, step ran, so it lacks them: "
            "re-run the cells that define _on_grad, step (in order), then this check")
    assert capsys.readouterr().out.splitlines() == [f"FAIL step, 2 ranks: values: {lost}",
                                                    f"FAIL step, 2 ranks: traffic: {lost}"]
    # In a notebook the class gets them back at the end of the cell that redefined it (`restore`).
    assert stepwise.restore(cls) == ["_on_grad", "step"] and cls().step() == 3 and stepwise.missing_methods(cls) == []


def test_interrupting_a_check_prints_one_line(capsys, monkeypatch):
    import distlab.checks.task as task
    from distlab.checks.ch01 import grade

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(task, "grade_task", interrupted)
    grade("all_gather", lambda tensor: tensor)
    out = capsys.readouterr()
    assert out.out.splitlines() == ["interrupted: the check of 'all_gather' was stopped before it finished "
                                    "(no rank is left running)"] and out.err == ""


def test_a_check_prints_a_table_then_its_lines_with_a_shared_reason_once():
    from distlab.checks.ch01 import TASKS
    from distlab.checks.show import verdict_text
    from distlab.checks.task import Line
    task = TASKS["all_gather"]
    why = "hung: rank(s) [1] waited 5 s for each other"
    skip = "not run: an earlier case (3 ranks) hung"
    lines = [Line("all_gather, 2 ranks, values", True, "right on every rank in 12 cases"),
             Line("all_gather, 2 ranks, traffic", False, "rank 0 called all_reduce: use only send/recv"),
             Line("all_gather, 3 ranks, values", False, why), Line("all_gather, 3 ranks, traffic", False, why),
             Line("all_gather, 4 ranks, values", False, skip), Line("all_gather, 4 ranks, traffic", False, skip)]
    assert verdict_text(task, lines) == [
        "all_gather  2 ranks  3 ranks  4 ranks",
        "  values    PASS     FAIL     -",
        "  traffic   FAIL     FAIL     -",
        "PASS all_gather, 2 ranks, values: right on every rank in 12 cases",
        "FAIL all_gather, 2 ranks, traffic: rank 0 called all_reduce: use only send/recv",
        "FAIL all_gather, 3 ranks, values", "FAIL all_gather, 3 ranks, traffic", f"  why: {why}",
        "FAIL all_gather, 4 ranks, values", "FAIL all_gather, 4 ranks, traffic", f"  why: {skip}"]


def test_a_whole_multiple_of_the_reference_gets_a_hint():
    with pytest.raises(CheckFailed, match=r"; yours is 4x the reference: a sum where a mean is expected\?$"):
        compare(torch.tensor([4.0, 8.0, -2.0]), torch.tensor([1.0, 2.0, -0.5]))
    with pytest.raises(CheckFailed, match=r"; yours is 1/2 of the reference: a mean where a sum is expected"):
        compare(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]))
    with pytest.raises(CheckFailed, match=r"\(tolerance atol=1e-06, rtol=1e-05\)$"):   # no hint: not a multiple
        compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))


def test_help_of_grade_lists_each_task_its_answers_its_ranks_and_its_lines():
    import pydoc

    from distlab.checks import LABS, lab_module
    from distlab.checks.ch01 import grade
    doc = grade.__doc__
    assert doc.startswith("grade(task, *answers): run a graded task on real ranks and print its verdicts.")
    assert ("grade('all_gather', ring_all_gather): 3 case(s), on 2, 3 and 4 ranks\n"
            "    all_gather, 2 ranks, values\n    all_gather, 2 ranks, traffic\n    all_gather, 3 ranks, values\n") in doc
    assert "all_gather, 4 ranks, traffic" in pydoc.render_doc(grade, renderer=pydoc.plaintext)   # what help() shows
    for lab in LABS:          # every lab's help names each task, the names it takes and every verdict line, in order
        module = lab_module(lab)
        doc = module.grade.__doc__
        for name, task in module.TASKS.items():
            at = doc.index(f"grade({name!r}, {', '.join(task.answers)}): {len(task.cases())} case(s), on ")
            lines = doc[at:].split("\n\n")[0].splitlines()[1:]
            assert lines == [f"    {line}" for line in task.lines()], (lab, name)


def test_a_notebook_run_by_hand_records_into_yours_and_the_tour_report_shows_it(tmp_path, monkeypatch):
    # issue 34: a lab's "record for the tour" cell used to write to labs/results/, which the tour never read
    from distlab.meters import records
    from distlab.viz.report import build
    monkeypatch.delenv("DISTLAB_RESULTS")
    monkeypatch.setattr(records, "yours_dir", lambda: tmp_path / "yours")
    rec = record("ring_ratio", world_size=4, bytes=2**22, ratio=0.61)
    assert rec["source"] == "learner"
    mine = load_records(tmp_path / "yours")
    assert mine == {"ring_ratio": [{"world_size": 4, "bytes": 2**22, "ratio": 0.61, "source": "learner"}]}
    monkeypatch.setenv("DISTLAB_RESULTS", str(tmp_path / "tour"))   # the tour's own runs are not "yours"
    assert "source" not in record("ring_ratio", world_size=4, bytes=2**22, ratio=0.9)
    summary = {"machine": {"device_count": 1, "device_kind": "cpu", "backend": "gloo", "torch_version": "x",
                           "cpu_count": 2}, "mode": "quick",
               "collectives": [{"op": "all_reduce", "impl": "library", "bytes": 2**22, "busbw_GBps": 1.0,
                                "world_size": 4}],
               "ring_ratio": load_records(tmp_path / "tour")["ring_ratio"], "yours": mine}
    text = build(summary, []).markdown()
    assert "Your ring all-reduce at 4 MiB: 0.61x the library's busbw on 4 ranks." in text
    assert "The shipped solution's ring all-reduce at 4 MiB: 0.90x" in text
    assert "## Yours: the notebooks you ran by hand" in text and "| 4 | 4,194,304 | 0.61 |" in text


def test_notebooks_under_pytest_never_record_into_yours():
    import os

    from distlab.meters.records import results_dir, yours_dir
    assert os.environ.get("DISTLAB_RESULTS") and results_dir() != yours_dir()
