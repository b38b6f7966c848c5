"""`distlab grade`: synthetic classes for chapters 1 and 2, every tampering route, no orphans.

The slow tests grade one check cell per chapter (`only=`), several submissions
at a time (`jobs=3`); the cheap mini lab (one 2-rank launch per check) carries
the tampering routes.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import psutil
import pytest

from distlab.grading.grade import _fail_reason, grade
from distlab.grading.build import extract_answers, load_lab, read_submission
from distlab.grading.remote import GradingError, RemoteAnswer, safe_loads

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_class", ROOT / "tests/fixtures/grading/make_class.py")
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

MARKER = "distlab-grading-orphan-marker"


def _scores(results):
    return {Path(r.submission).stem: r.score for r in results}


def _reasons(results, stem):
    r = next(r for r in results if Path(r.submission).stem == stem)
    return [v.reason for v in r.verdicts]


def _marker_processes():
    out = []
    for p in psutil.process_iter():
        try:
            if MARKER in " ".join(p.cmdline()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


# ---------------------------------------------------------------- the mini lab: tampering routes

def _mini(tmp_path):
    lab = mk.mini_lab(points=2)
    lab_path = tmp_path / "mini_lab.ipynb"
    nbformat.write(lab, lab_path)
    good = mk.mini_solution(lab)
    ids = list(good)
    return lab, lab_path, good, ids


def _route_answers(good, ids, prelude="", body=None, tail=""):
    """Both answers: `prelude` at the top of the cell, a wrong body (or `body`), `tail` after."""
    out = {}
    for cid, src in good.items():
        name = "double" if "def double" in src else "negate"
        fn = body or "    return t + 1          # wrong on purpose\n"
        out[cid] = f"{prelude}\ndef {name}(t):\n{fn}\n{tail}"
    return out


ROUTES = {
    # route name: (answers builder args, check cells handling)
    "redefine_check_print_compare": dict(prelude=(
        "import builtins\n"
        "def check(name, fn):\n    print('PASS ' + name + ': exact')\n"
        "def compare(*a, **k):\n    return 'exact'\n"
        "builtins.print = lambda *a, **k: None\n"
        "print = lambda *a, **k: None\n")),
    "monkeypatch_distlab_checks": dict(prelude=(
        "import sys, torch, distlab.checks as dc\n"
        "dc.check = lambda name, fn: (sys.stdout.write('PASS ' + name + ': exact\\n'), True)[1]\n"
        "dc.compare = lambda *a, **k: 'exact'\n"
        "dc.CheckFailed = KeyError\n"
        "sys.modules['distlab.checks'].expect = lambda *a, **k: None\n"
        "torch.equal = lambda *a, **k: True\n"
        "torch.allclose = lambda *a, **k: True\n")),
    "fake_pass_lines": dict(prelude=(
        "import os, sys\n"
        "print('PASS double on 2 ranks: exact')\nprint('PASS negate on 2 ranks: exact')\n"
        "os.write(1, b'PASS double on 2 ranks: exact\\n')\n"
        "sys.__stdout__.write('PASS negate on 2 ranks: exact\\n')\n"),
        body="    print('PASS double on 2 ranks: exact')\n    return t + 1\n"),
    "os_exit_at_top_level": dict(prelude="import os\nos._exit(0)\n"),
    "infinite_loop": dict(body="    while True:\n        pass\n"),
    "output_flood": dict(body="    while True:\n        print('x' * 4096)\n"),
    "evil_result_pickle": dict(prelude=(
        "class Evil:\n    def __reduce__(self):\n"
        "        return (exec, (\"import distlab.checks as c; c.check = lambda n, f: print('PASS ' + n + ': exact')\","
        "))\n"), body="    return Evil()\n"),
    "orphan_daemon": dict(prelude=(
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {MARKER}'],"
        " start_new_session=True, env={})\n")),
}


def test_every_tampering_route_scores_zero_and_leaves_nothing(tmp_path, no_orphans):
    lab, lab_path, good, ids = _mini(tmp_path)
    subs = {"correct": mk.submission(lab, good),
            "edited_check_cell": mk.submission(lab, None, checks="tamper"),
            "deleted_check_cells": mk.submission(lab, good, checks="delete"),     # gains nothing, loses nothing
            "moved_check_cells": mk.submission(lab, None, checks="move")}
    for name, kw in ROUTES.items():
        subs[name] = mk.submission(lab, _route_answers(good, ids, **kw))
    paths = mk.write(subs, tmp_path / "class")
    results = grade(lab_path, list(paths.values()), out=tmp_path / "grades", cell_timeout=90,
                    rank_timeout=8, jobs=3, echo=False)
    scores = _scores(results)
    assert scores == {name: (3 if name in ("correct", "deleted_check_cells") else 0) for name in subs}, scores
    assert all("not implemented yet" in r for r in _reasons(results, "edited_check_cell"))
    assert all("timed out: rank(s)" in r for r in _reasons(results, "infinite_loop"))
    assert all("exited with code" in r or "died" in r for r in _reasons(results, "os_exit_at_top_level"))
    assert all("File too large" in r for r in _reasons(results, "output_flood"))   # RLIMIT_FSIZE on ranks
    assert all("does not unpickle" in r for r in _reasons(results, "evil_result_pickle"))
    flags = next(r.flags for r in results if Path(r.submission).stem == "monkeypatch_distlab_checks")
    assert any("assigns to dc.check" in f for f in flags) and any("torch.equal" in f for f in flags)
    assert not _marker_processes(), "a learner's daemon survived the grading"


def test_cli_self_check_interrupts_a_cell_past_its_timeout(tmp_path, capsys, no_orphans):
    from distlab.cli import main
    lab, lab_path, good, ids = _mini(tmp_path)
    answers = _route_answers(good, ids, body="    while True:\n        pass\n")
    answers[ids[1]] = good[ids[1]]                         # negate is right: the loop only costs double
    paths = mk.write({"loop": mk.submission(lab, answers)}, tmp_path / "class")
    rc = main(["grade", "--self", str(lab_path), str(paths["loop"]), "--timeout", "6", "--rank-timeout", "600"])
    out = capsys.readouterr().out
    assert rc == 1, out                                    # --self: exit 1 unless full marks
    assert "| double on 2 ranks | 0/2 | FAIL: timed out: the check cell ran past 6 s" in out, out
    assert "| negate on 2 ranks | 1/1 | PASS |" in out and "**1/3**" in out, out


def test_the_graded_notebook_gives_the_same_verdicts_under_nbval(tmp_path, no_orphans):
    import subprocess
    import sys
    lab, lab_path, good, ids = _mini(tmp_path)
    subs = {"correct": mk.submission(lab, good),
            "redefined": mk.submission(lab, _route_answers(good, ids, **ROUTES["redefine_check_print_compare"]))}
    paths = mk.write(subs, tmp_path / "class")
    results = grade(lab_path, list(paths.values()), keep=tmp_path / "keep", rank_timeout=30, jobs=2, echo=False)
    assert _scores(results) == {"correct": 3, "redefined": 0}
    for name, want in (("correct", 0), ("redefined", 1)):
        (graded,) = (tmp_path / "keep").glob(f"{name}-*/graded.ipynb")
        run = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider",
                              "-p", "no:randomly", str(graded)], cwd=graded.parent, capture_output=True, text=True)
        assert run.returncode == want, run.stdout[-3000:]
        if want:   # nbval fails exactly the two check cells
            assert "2 failed" in run.stdout, run.stdout[-3000:]


# ---------------------------------------------------------------- chapters 1 and 2: a synthetic class each

def _grade_class(tmp_path, lab, klass, only):
    mk.write(klass, tmp_path / "class")
    return grade(lab, [tmp_path / "class"], out=tmp_path / "grades", only=only, cell_timeout=240, rank_timeout=15,
                 jobs=3, echo=True)


def _check_reports(tmp_path, results):
    rows = list(csv.DictReader(open(tmp_path / "grades/grades.csv")))
    totals = {Path(r["submission"]).stem: float(r["points"]) for r in rows if r["check"] == "TOTAL"}
    assert totals == _scores(results)
    assert all(r["reason"] and "\n" not in r["reason"] for r in rows if r["status"] == "fail")
    suites = ET.parse(tmp_path / "grades/junit.xml").getroot().findall("testsuite")
    assert len(suites) == len(results)
    assert sum(int(s.get("failures")) for s in suites) == sum(1 for r in rows if r["status"] == "fail")
    md = (tmp_path / "grades/grades.md").read_text()
    print(md)
    assert "| Submission | Score |" in md


def test_chapter1_class(tmp_path, no_orphans):
    """Graded on the reduce-scatter check cell: values and traffic on 2, 3 and 4 ranks (6 points)."""
    results = _grade_class(tmp_path, "01_collectives", mk.ch1_class(), only=["reduce_scatter"])
    assert _scores(results) == {"correct": 6, "not_started": 0, "wrong": 0, "partial": 3, "crashing": 0,
                                "hanging": 0, "tampered_check": 0, "deleted_check": 3, "invalid_json": 0,
                                "rank_side_patch": 0}
    assert any("called all_reduce" in r for r in _reasons(results, "partial"))
    assert any("max |your result - reference|" in r for r in _reasons(results, "rank_side_patch"))
    flags = next(r.flags for r in results if Path(r.submission).stem == "rank_side_patch")
    assert any("assigns to dist.all_reduce" in f for f in flags)
    assert all("not implemented yet" in r for r in _reasons(results, "not_started"))
    assert any("ZeroDivisionError" in r for r in _reasons(results, "crashing"))
    assert all("timed out" in r for r in _reasons(results, "hanging"))
    assert all("invalid JSON" in r for r in _reasons(results, "invalid_json"))
    _check_reports(tmp_path, results)


def test_chapter2_class(tmp_path, no_orphans):
    """Graded on the initial-broadcast check cell: one point per wrapper (3 points)."""
    results = _grade_class(tmp_path, "02_ddp", mk.ch2_class(), only=["initial broadcast"])
    assert _scores(results) == {"correct": 3, "not_started": 0, "wrong": 0, "partial": 1, "crashing": 0,
                                "hanging": 0, "tampered_check": 0, "deleted_check": 1, "invalid_json": 0}
    assert all("not implemented yet" in r for r in _reasons(results, "not_started"))
    assert any("ZeroDivisionError" in r for r in _reasons(results, "crashing"))
    assert all("timed out" in r for r in _reasons(results, "hanging"))
    _check_reports(tmp_path, results)


# ---------------------------------------------------------------- fast unit tests

def test_reason_is_taken_from_the_matching_fail_line():
    exp = "PASS NaiveDDP: initial broadcast from rank 0: every rank holds rank 0's weights"
    lines = ["FAIL NaiveDDP: initial broadcast from rank 0: rank 1's w differs",
             "FAIL Naive: something else"]
    assert _fail_reason(exp, lines) == "rank 1's w differs"
    assert _fail_reason("PASS x, 2 ranks: 24 cases", ["PASS x, 2 ranks: 12 cases"]).startswith("passed with a different")
    assert _fail_reason("PASS y: ok", ["FAIL x: no"]) is None


def test_answers_are_matched_by_id_then_order_then_name(tmp_path):
    lab = load_lab(ROOT / "labs/01_collectives.ipynb")
    sub = nbformat.read(ROOT / "labs/01_collectives.ipynb", as_version=4)
    for i, cell in enumerate(c for c in sub.cells if "answer" in c.metadata.get("tags", [])):
        cell.source += f"\n# learner {i}"
        cell.id = f"renamed{i}"                       # ids lost: order among answer cells
    cells, missing = extract_answers(lab, sub)
    assert not missing and [src.endswith(f"# learner {i}") for i, (_, src) in enumerate(cells)] == [True] * 4
    for cell in sub.cells:
        cell.metadata["tags"] = []                    # tags lost too: found by the names they define
    sub.cells = [c for c in sub.cells if "def ring_all_gather" not in c.source]
    cells, missing = extract_answers(lab, sub)
    assert len(cells) == 3 and missing == ["no answer cell for ring_all_gather"]


def test_invalid_submissions_are_reported_in_one_line(tmp_path):
    (tmp_path / "a.ipynb").write_text("{not json")
    (tmp_path / "b.ipynb").write_text('{"cells": 3}')
    for name in ("a", "b"):
        nb, why = read_submission(tmp_path / f"{name}.ipynb")
        assert nb is None and why.startswith("not a notebook") and "\n" not in why


def test_answers_cannot_be_called_in_the_kernel_and_results_cannot_carry_code():
    import cloudpickle
    import torch
    handle = RemoteAnswer(__import__("distlab.grading.remote").grading_remote.Answers([], ["f"]), "f", {})
    with pytest.raises(GradingError):
        handle(1)
    assert torch.equal(safe_loads(cloudpickle.dumps({"t": torch.arange(3)}))["t"], torch.arange(3))

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(Exception, match="does not unpickle"):
        safe_loads(cloudpickle.dumps(Evil()))


def test_audit_flags_code_that_could_tamper_on_a_rank():
    from distlab.grading.report import audit
    src = ("import torch.distributed as dist\n"
           "def ring_all_reduce(t, op=None):\n"
           "    dist.all_reduce = lambda *a, **k: None\n"
           "    setattr(dist, 'send', None)\n"
           "    vars(dist)['recv'] = None\n"
           "    return t\n")
    notes = audit(src)
    assert any("assigns to dist.all_reduce" in n for n in notes)
    assert any("setattr" in n for n in notes) and any("vars" in n for n in notes)
    assert audit("def f(t):\n    return 2 * t\n") == []
