"""Shared test set-up: quick mode, results in a temp folder, no stray processes."""
from __future__ import annotations

import os

import psutil
import pytest

os.environ.setdefault("DISTLAB_QUICK", "1")
# Every launch in the suite (notebooks under nbval included: their kernels inherit this) runs under
# the device audit: on these CPU ranks it enforces what NCCL would (see distlab.audit).
os.environ.setdefault("DISTLAB_DEVICE_AUDIT", "1")


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
