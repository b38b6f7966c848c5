"""Shared test set-up: quick mode, results in a temp folder, no stray processes."""
from __future__ import annotations

import os

import psutil
import pytest

os.environ.setdefault("DISTLAB_QUICK", "1")
# Every launch in the suite (notebooks under nbval included: their kernels inherit this) runs under
# the device audit: on these CPU ranks it enforces what NCCL would (see distlab.engine.audit).
os.environ.setdefault("DISTLAB_DEVICE_AUDIT", "1")


# The suite runs on xdist workers, a file (a notebook) at a time, in collection order
# (`--no-loadscope-reorder`): the files that take longest go first, so that the run does not end with one
# worker on a long file while the other is idle. Roughly longest first: the sandboxed grading (two
# submissions at a time), the torchrun cluster jobs, the simulations (the planner's recipes, fake against
# gloo), the browser, the labs' stubs, the tour, then the notebooks (solutions before lectures, later
# chapters first), then everything else in its usual order.
LONGEST_FIRST = ("tests/test_grading_class.py", "tests/test_cluster.py", "tests/test_sim.py",
                 "tests/test_browser.py", "tests/test_labs.py", "tests/test_tour.py", "tests/test_launch.py")


def _file_rank(path: str) -> tuple:
    if path in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(path))
    folder, _, name = path.partition("/")
    if folder in ("solutions", "notebooks") and name.endswith(".ipynb"):
        return (1, folder != "solutions", -int(name[:2]) if name[:2].isdigit() else 0)
    return (2,)


def pytest_collection_modifyitems(session, config, items):
    root = str(config.rootpath)
    order = {id(item): n for n, item in enumerate(items)}
    rank = {id(item): _file_rank(os.path.relpath(str(item.path), root)) for item in items}
    items.sort(key=lambda item: (rank[id(item)], order[id(item)]))   # stable within a file


@pytest.fixture(autouse=True)
def _results_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_RESULTS", str(tmp_path / "results"))


def rank_processes() -> set[int]:
    """Our descendants that are distlab ranks (not the long-lived forkserver)."""
    me = psutil.Process()
    out = set()
    for p in me.children(recursive=True):
        try:
            if p.name().startswith("distlab-rank") or "distlab-rank" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_orphans():
    """Fail if a test leaves any descendant process behind (forkserver helpers aside)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftover = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            if _is_helper(p):
                continue
            leftover.append(f"{p.pid} {p.name()} {p.cmdline()[:3]}")
        except psutil.NoSuchProcess:
            pass
    assert not leftover, f"processes left running: {leftover}"


def _is_helper(p: psutil.Process) -> bool:
    """multiprocessing's forkserver and resource tracker live for the whole session by design."""
    cmd = " ".join(p.cmdline())
    return "forkserver" in cmd or "resource_tracker" in cmd


# The hang tests: a check's stall window, shortened from the learner's CHECK_STALL_S (5 s) to this. Hangs
# are found by lack of CPU progress, so a busy machine does not trip it: ranks that work still accrue CPU time.
SHORT_STALL_S = 2


@pytest.fixture
def short_stall(monkeypatch):
    """A check's hang is declared after SHORT_STALL_S seconds without progress (the messages say so)."""
    import distlab.checks.task as task
    monkeypatch.setattr(task, "CHECK_STALL_S", float(SHORT_STALL_S))
    return SHORT_STALL_S
