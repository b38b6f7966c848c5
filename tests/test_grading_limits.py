"""Issue 28: a submission's memory is limited as a whole, not only per process.

RLIMIT_DATA stops one process; a submission of many ranks, each under it, could still take the machine.
The grader (outside the sandbox, out of the learner's reach) adds up the private resident memory of the
submission's whole process tree while it runs and stops it past the limit, with a reason.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from distlab.grading import sandbox
from distlab.grading.cli import sandbox_for

BWRAP = sandbox.bwrap_path() is not None and (sandbox.works(True) or sandbox.works(False))

# a parent and two children, each touching `mib` MiB of its own memory, then lingering
TREE = textwrap.dedent('''
    import os, sys, time
    mib, linger = int(sys.argv[1]), float(sys.argv[2])
    def touch():
        block = bytearray(mib << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        return block
    for _ in range(2):
        if os.fork() == 0:              # a child: touch, then wait to be stopped (or for the parent's end)
            held = touch()
            time.sleep(linger)
            os._exit(0)
    held = touch()
    time.sleep(linger)
    for _ in range(2):
        os.wait()
''')


def _run(mib: int, limit_mib: int, linger_s: float):
    proc = subprocess.Popen([sys.executable, "-c", TREE, str(mib), str(linger_s)], stdout=subprocess.PIPE, text=True)
    try:
        out = sandbox.Outcome()
        code = sandbox._wait(proc, 60, threading.Event(), limit_mib << 20, out)
        return code, out
    finally:
        sandbox.procs.kill_tree([proc.pid])
        proc.wait()


def test_processes_each_under_the_limit_but_over_it_together_are_stopped_with_a_reason(no_orphans):
    code, out = _run(mib=200, limit_mib=500, linger_s=30)
    assert code is None, code
    assert "past the submission's memory limit" in out.failure and "--max-memory" in out.failure, out.failure
    assert out.peak_bytes > 500 << 20, out.peak_bytes


def test_a_submission_under_the_limit_runs_to_its_end_and_reports_its_peak(no_orphans):
    code, out = _run(mib=50, limit_mib=2048, linger_s=2)
    assert code == 0 and out.failure == "", (code, out.failure)
    assert 100 << 20 < out.peak_bytes < 2048 << 20, out.peak_bytes


# files in the sandbox's RAM-backed /tmp and /dev/shm, 40 MiB each (under the per-file size limit), then lingering
TMPFS = textwrap.dedent('''
    import sys, time
    for k in range(int(sys.argv[1])):
        with open(f"/dev/shm/f{k}" if k % 2 else f"/tmp/f{k}", "wb") as f:
            f.write(bytes(40 << 20))
    print("written", flush=True)
    time.sleep(30)
''')


@pytest.mark.skipif(not BWRAP, reason="bubblewrap is not usable here")
def test_files_in_the_sandbox_s_tmp_and_dev_shm_count_against_the_memory_limit(no_orphans):
    """Issue 38: a submission held 3.8 GiB of host memory in its tmpfs under --max-memory 1. The tmpfs are sized
    to the limit and what they hold counts with the processes' memory."""
    limit = 200 << 20
    cmd = sandbox.sized(sandbox_for(False, lambda text: None), limit)
    assert cmd.count(str(limit)) == 2 and str(sandbox.TMP_BYTES) not in cmd
    proc = subprocess.Popen(cmd + ["--", sys.executable, "-I", "-c", TMPFS, "6"], stdout=subprocess.PIPE, text=True)
    try:
        out = sandbox.Outcome()
        code = sandbox._wait(proc, 60, threading.Event(), limit, out, tmpfs=True)
    finally:
        sandbox.procs.kill_tree([proc.pid])
        proc.wait()
    assert code is None and "its /tmp and /dev/shm together held" in out.failure, (code, out.failure)
    assert out.peak_bytes > 200 << 20, out.peak_bytes
