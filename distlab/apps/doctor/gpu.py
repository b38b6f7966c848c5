"""`distlab doctor --gpu`: check the whole course on this machine's GPUs, in one command.

For an instructor validating a workstation (or a course maintainer with a GPU
for a few minutes). On a machine with at least one CUDA GPU it runs, in order:

1. the NCCL launch, an all-reduce and the memory meter against the CUDA
   allocator (`distlab doctor --run`'s job, on NCCL);
2. the GPU-marked tests (`pytest -m gpu tests/`): NCCL training steps, FSDP on
   a CUDA mesh, CUDA timelines, the meters on the device;
3. every chapter's lecture and solution notebook in quick mode at the
   machine's GPU count (`DISTLAB_WORLD_SIZE` = GPUs), under `pytest --nbval-lax`,
   so each notebook runs and its graded checks must print the solution's
   verdicts. NCCL runs one rank per GPU: with one GPU the measurements run at
   world size 1 on NCCL (all of the device placement is exercised) and the
   multi-rank checks fall back to gloo, as a learner's would.

It prints one line per step and a summary of what passed; the exit status is
0 only if everything passed. It needs the course checkout (notebooks/, tests/).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _notebooks(root: Path) -> list[Path]:
    """Every lecture and every solution (the solutions run each lab's graded checks), in chapter order."""
    return sorted([*root.glob("notebooks/*.ipynb"), *root.glob("solutions/*.ipynb")],
                  key=lambda p: (p.name[:2], p.parent.name != "notebooks", p.name))


def _junit_id(book: Path, root: Path) -> str:
    """The junit classname nbval's items get for `book`: its path from the checkout, dots for slashes."""
    return ".".join(book.relative_to(root).parts)


def results_of(book: Path, root: Path, results: list[tuple[str, str]]) -> list[str]:
    """The statuses of `book`'s own cells: matched on its whole path, so solutions/08_pipeline is not
    notebooks/08_pipeline_3d_lecture, and a lecture is not the solution of the same name."""
    mine = _junit_id(book, root) + "::"
    return [status for test, status in results if test.startswith(mine)]


def _end_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop pytest and everything it started (kernels start in sessions of their own, so a process group
    does not reach them; the process tree does): an interrupt first, so nbval shuts its kernels down and
    distlab's launches stop their ranks, then a kill for whatever is left."""
    import signal

    import psutil
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        tree += psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # Until each is gone or a zombie (dead; its new parent, not us, reaps it when it gets to it: psutil's
    # wait_procs would wait for that reaping too, ~1 s here).
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.02)
    proc.wait()


def _alive(p: Any) -> bool:
    import psutil
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pytest(args: list[str], env: dict[str, str], junit: Path, timeout: float,
            cwd: Path | None = None) -> tuple[int, list[tuple[str, str]]]:
    """Run pytest; return (exit code, [(test id, 'passed' | 'failed' | 'skipped')]); -1 when it ran past
    `timeout`, and then nothing it started is left running (no kernel or rank keeps holding a GPU)."""
    import importlib.util
    # One pytest process: NCCL ranks of two notebooks at once would share the GPUs (and skew timings).
    serial = ["-n", "0"] if importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *serial, f"--junitxml={junit}", *args]
    with open(junit.with_suffix(".log"), "w") as log:          # pytest's own output, beside its junit file
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _end_tree(proc)
            code = -1
    results = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            status = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                status = "failed"
            elif case.find("skipped") is not None:
                status = "skipped"
            results.append((f"{case.get('classname', '')}::{case.get('name', '')}", status))
    return code, results


def gpu_check(root: Path | None = None, out: Path | None = None) -> int:
    """Run the three steps above; print what passed; return an exit status."""
    import tempfile

    import torch

    from distlab.apps.doctor.local import run_checks
    from distlab.engine.machine import machine
    from distlab.apps.tour import repo_root
    info = machine()
    if not info["gpu_count"]:
        print("distlab doctor --gpu: no CUDA GPU is visible to torch here, so there is nothing to check on GPUs. "
              "On a GPU machine, install the CUDA build of torch first (pytorch.org), then run this again.")
        return 2
    root = root or repo_root()
    if root is None:
        print("distlab doctor --gpu needs the course checkout (notebooks/ and tests/): run it from a clone.")
        return 2
    out = Path(out or tempfile.mkdtemp(prefix="distlab-gpucheck-"))
    out.mkdir(parents=True, exist_ok=True)
    n = info["gpu_count"]
    print(f"{n} x {info['device_kind']}, NCCL {info['nccl_version']}, torch {info['torch_version']}")
    summary: list[tuple[str, bool, str]] = []

    start = time.monotonic()
    problems = run_checks(info)
    summary.append(("NCCL launch, all-reduce, memory meter vs allocator", not problems, "; ".join(problems)))

    env = dict(os.environ, DISTLAB_QUICK="1", DISTLAB_WORLD_SIZE=str(n), DISTLAB_RESULTS=str(out / "results"),
               MPLBACKEND="Agg")
    env.pop("DISTLAB_DEVICE_AUDIT", None)   # the GPU enforces the rule itself
    code, tests = _pytest(["-m", "gpu", str(root / "tests")], env, out / "gpu-tests.xml", timeout=600, cwd=root)
    ran = [t for t in tests if t[1] != "skipped"]
    failed = [t for t, s in tests if s == "failed"]
    summary.append((f"GPU-marked tests ({len(ran)} ran)", code == 0 and bool(ran), ", ".join(failed)))

    books = _notebooks(root)
    code, cells = _pytest(["--nbval-lax", *map(str, books)], env, out / "notebooks.xml", timeout=1800, cwd=root)
    for book in books:
        mine = results_of(book, root, cells)
        bad = mine.count("failed")
        summary.append((f"{book.relative_to(root)} at N={n}", bool(mine) and bad == 0,
                        f"{bad} cell(s) failed" if bad else ("" if mine else "did not run")))

    print()
    for name, ok, why in summary:
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {why}" if why and not ok else ""))
    passed = sum(ok for _, ok, _ in summary)
    print(f"\n{passed}/{len(summary)} passed in {time.monotonic() - start:.0f} s on {n} GPU(s); "
          f"logs in {out}")
    del torch
    return 0 if passed == len(summary) else 1


def describe(info: dict[str, Any]) -> str:
    """How many ranks each part of the course gets on this machine's GPUs."""
    n = info["gpu_count"]
    return (f"NCCL with {n} rank(s), one per GPU; launches asking for more ranks run on gloo (CPU)"
            if n else "no GPU: every launch runs on gloo (CPU)")
