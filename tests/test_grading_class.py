"""`distlab grade` end to end, sandboxed: the chapter-1 class, one attack per route of issue 11, the
sandbox's walls, broken files, and every lab whose check module exists (solution: full marks, unfilled
lab: zero).

One class run grades the chapter-1 class, the attacks and the broken files together (the reduce-scatter
task: 3 cases, 6 points each), two submissions at a time, as an instructor would.
"""
from __future__ import annotations

import csv
import importlib
import importlib.util
import os
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from distlab.grading import sandbox
from distlab.grading.cli import sandbox_for
from distlab.grading.classrun import grade
from distlab.grading.grade import Options, prepare

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_class", ROOT / "tests/fixtures/grading/make_class.py")
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

# A class run is minutes of CPU on a busy machine; slow is not failed (the grader has its own hang detection).
pytestmark = pytest.mark.timeout(1800)

needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None or not sandbox.works(),
                                 reason="bubblewrap is not usable here (the attacks must only run sandboxed)")


def _by_stem(results):
    return {Path(r.submission).stem: r for r in results}


@pytest.fixture(scope="module")
def class_run(tmp_path_factory):
    """Grade the chapter-1 class (reduce-scatter: 3 cases), then the attacks and broken files (its 2-rank
    case), as an instructor would: two submissions at a time, reports written."""
    folder = tmp_path_factory.mktemp("class")
    box = sandbox_for(False)
    mk.write(mk.ch1_class(), folder / "class")
    results = grade(prepare("01_collectives", ["reduce_scatter"]), [folder / "class"], out=folder / "grades",
                    jobs=2, opts=Options(sandbox=box))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    mk.write({**mk.attacks(os.getpid(), listener.getsockname()[1]), **mk.malformed()}, folder / "attacks")
    results += grade(prepare("01_collectives", ["reduce_scatter, 2 ranks"]), [folder / "attacks"],
                     out=folder / "attack_grades", jobs=2, opts=Options(sandbox=box))
    listener.close()
    return _by_stem(results), folder / "attack_grades"


@needs_bwrap
def test_chapter1_class_scores(class_run):
    got, _ = class_run
    scores = {name: got[name].score for name in mk.ch1_class()}
    assert scores == {"correct": 6, "not_started": 0, "wrong": 0, "partial": 3, "crashing": 0, "hanging": 0,
                      "tampered_check": 0, "deleted_check": 3, "rank_side_patch": 0, "invalid_json": 0}
    reasons = {name: [v.reason for v in got[name].verdicts] for name in scores}
    assert reasons["partial"][1::2] == ["rank 0 called all_reduce: use only send/recv (isend/irecv)"] * 3
    assert all(r.startswith("not implemented yet") for r in reasons["not_started"])
    assert any("ZeroDivisionError" in r for r in reasons["crashing"])
    assert reasons["hanging"][0].startswith("hung: rank(s)") and "a receive has no matching send" in reasons["hanging"][0]
    assert reasons["hanging"][2:] == ["not run: an earlier case (2 ranks) hung"] * 4
    assert got["rank_side_patch"].flags == ["reduce_scatter: rebound torch.distributed.all_reduce "
                                            "(after your answer cells ran) [ranks 0, 1, 2, 3]"] or \
        all("rebound torch.distributed.all_reduce" in f for f in got["rank_side_patch"].flags)
    assert all(r.startswith("not a notebook: invalid JSON") for r in reasons["invalid_json"])
    # check cells are never read: these hand in the same answer cells as `wrong` and `partial`, graded once
    assert got["wrong"].note == "same answer cells as class/tampered_check.ipynb (graded once)"
    assert got["partial"].note == "same answer cells as class/deleted_check.ipynb (graded once)"
    assert not got["correct"].flags and not got["partial"].flags and not got["not_started"].flags


@needs_bwrap
def test_route1_changing_the_comparison_or_the_reference_changes_nothing(class_run):
    r = class_run[0]["route1_patch_comparison"]
    assert r.score == 0
    assert all(v.judged.startswith("FAIL") for v in r.verdicts[0::2])     # judged here: the values are wrong
    assert any("object.__setattr__ __code__" in f for f in r.flags)
    assert any("rebound torch.distributed.all_reduce" in f for f in r.flags)


@needs_bwrap
def test_route2_a_switched_off_meter_hides_no_traffic(class_run):
    r = class_run[0]["route2_meter_off_decoys"]
    assert r.score == 1                                                     # the values are right (the library's)
    assert [v.reason for v in r.verdicts] == ["", "rank 0 called all_reduce: use only send/recv (isend/irecv)"]


@needs_bwrap
def test_route3_printing_through_proc_reaches_no_verdict(class_run):
    r = class_run[0]["route3_print_through_proc"]
    assert r.score == 0 and all(v.reason.startswith("audit: ") for v in r.verdicts)
    assert any("open /proc/<pid>/fd/1 for writing" in f for f in r.flags), r.flags


@needs_bwrap
def test_route4_forging_results_and_killing_the_worker_scores_zero(class_run):
    r = class_run[0]["route4_forge_and_kill_worker"]
    assert r.score == 0
    assert r.note == "the grading runner was killed by SIGKILL before it finished: a rank may have killed it"


@needs_bwrap
def test_route5_a_result_that_runs_code_is_refused(class_run):
    r = class_run[0]["route5_malformed_result"]
    assert r.score == 0
    assert all("the ranks returned a builtins.print, which the grader does not unpickle" in v.judged
               for v in r.verdicts)
    assert any("rebound distlab.checks.ch01.RingTask.exercise" in f for f in r.flags), r.flags


@needs_bwrap
def test_route6_the_solutions_are_not_in_the_sandbox(class_run):
    r = class_run[0]["route6_exec_solutions"]
    assert r.score == 0
    assert all("the solutions were not there" in v.judged for v in r.verdicts)
    assert any("open " in f and "solutions/01_collectives.ipynb" in f for f in r.flags)


@needs_bwrap
def test_route7_built_names_do_not_hide_from_the_audit(class_run):
    r = class_run[0]["route7_built_names"]
    assert r.score == 0
    assert any("gc.get_objects" in f for f in r.flags) and any("sys._getframe" in f for f in r.flags)


@needs_bwrap
def test_a_rank_cannot_see_the_grader_read_solutions_or_reach_the_network(class_run):
    import json
    r = class_run[0]["probe_sandbox"]
    probe = json.loads(r.verdicts[0].judged.split("PROBE ", 1)[1])
    assert probe["grader"] is False and probe["npids"] < 20, probe     # its own PID namespace
    assert probe["solutions"] is False and probe["labs"] is False, probe
    assert probe["net"] == "ConnectionRefusedError", probe              # the grader's listener is not there
    assert any("socket.connect" in f for f in r.flags) and any("subprocess.Popen" in f for f in r.flags)
    leftover = [p.pid for p in psutil.process_iter() if _cmdline_has(p, mk.MARKER)]
    assert not leftover, "a learner's daemon outlived its sandbox"


def _cmdline_has(p, marker: str) -> bool:
    try:
        return marker in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


@needs_bwrap
def test_an_output_flood_fails_its_rank_not_the_run(class_run):
    r = class_run[0]["output_flood"]
    assert r.score == 0 and not r.note
    assert all("File too large" in v.reason for v in r.verdicts), [v.reason for v in r.verdicts]


@needs_bwrap
def test_broken_files_get_one_line_and_the_class_run_writes_every_report(class_run):
    got, out = class_run
    for name in mk.malformed():
        assert got[name].score == 0 and got[name].note.startswith(("not a notebook", "the file is")), got[name].note
    rows = list(csv.DictReader(open(out / "grades.csv")))
    totals = {Path(r["submission"]).stem: float(r["points"]) for r in rows if r["check"] == "TOTAL"}
    assert totals == {name: got[name].score for name in totals} and len(totals) == len(mk.attacks(0, 0)) + 4
    assert all(r["reason"] and "\n" not in r["reason"] for r in rows if r["status"] == "fail")
    suites = ET.parse(out / "junit.xml").getroot().findall("testsuite")
    assert len(suites) == len(totals)
    md = (out / "grades.md").read_text()
    assert "| Submission | Score | Max | Passed | Note / first failure | Audit |" in md


# ---------------------------------------------------------------- every lab with a check module

def _labs_with_modules() -> list[str]:
    from distlab.checks import LABS
    out = []
    for lab, module in LABS.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        if (ROOT / "labs" / f"{lab}.ipynb").exists() and (ROOT / "solutions" / f"{lab}.ipynb").exists():
            out.append(lab)
    return out


@needs_bwrap
@pytest.mark.parametrize("lab_name", _labs_with_modules())
def test_solutions_get_full_marks_and_unfilled_labs_zero(lab_name, tmp_path, no_orphans):
    from distlab.grading.lab import Graded
    lab = prepare(lab_name)
    lab.graded = [Graded(g.task, g.names, g.cases[:1]) for g in lab.graded]   # every task, its first case
    mk.write(mk.solution_and_unfilled(lab_name), tmp_path / "subs")
    got = _by_stem(grade(lab, [tmp_path / "subs"], jobs=2, opts=Options(sandbox=sandbox_for(False))))
    full = sum(v.max_points for v in got["correct"].verdicts)
    assert got["correct"].score == full and not got["correct"].flags, [
        (v.check, v.reason) for v in got["correct"].verdicts if v.reason] + got["correct"].flags
    assert got["not_started"].score == 0 and not got["not_started"].flags
    assert all(v.reason.startswith("not implemented yet") for v in got["not_started"].verdicts)


def test_self_check_prints_progress_and_a_one_line_summary(tmp_path, capsys, no_orphans):
    from distlab.cli import main
    nb = tmp_path / "mine.ipynb"
    mk.write({"mine": mk.submission(mk.shipped("01_collectives"), mk.solution_answers("01_collectives"))}, tmp_path)
    rc = main(["grade", "--self", "--no-sandbox", "01_collectives", str(nb), "--only", "all_gather, 2 ranks"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "--no-sandbox: submissions run as you" in captured.err
    assert "  [1/1] all_gather, 2 ranks: ran" in captured.out
    assert captured.out.rstrip().splitlines()[-1].startswith(f"{nb}: 2/2 points, 2/2 checks passed in ")
