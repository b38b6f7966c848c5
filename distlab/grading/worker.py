"""Execute one graded notebook in its own worker process, kernel and ranks; leave nothing behind.

The grader starts `python -m distlab.grading.worker IN FD CELL_TIMEOUT` in a new
process session with a unique token in its environment. The worker runs the
notebook with nbclient (per-cell timeout, interrupt on timeout, errors kept as
cell outputs) and sends each executed cell back on a pipe
only it holds. The kernel, its forkserver and the ranks
inherit the token. The worker is a child subreaper: whatever a rank starts,
even in a new session or with a cleared environment, stays below it, and the
worker kills all of it before it exits; the grader then kills the worker's
session and anything still carrying the token. Every
file a worker, kernel or rank writes is capped (RLIMIT_FSIZE), so a flood of
output stops the process that floods instead of filling the disk.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Callable

import nbformat

import psutil

TOKEN_VAR = "DISTLAB_GRADE_TOKEN"
MAX_FILE_BYTES = 16 << 20       # per file written by the worker, kernel or a rank
MAX_OUTPUT_CHARS = 20_000       # kept per output in the executed notebook


def _truncate(cell: nbformat.NotebookNode) -> None:
    for out in cell.get("outputs", []):
        if isinstance(out.get("text"), str) and len(out["text"]) > MAX_OUTPUT_CHARS:
            out["text"] = out["text"][:MAX_OUTPUT_CHARS] + "\n[... output truncated by distlab grade]\n"
        if "traceback" in out:
            out["traceback"] = out["traceback"][-20:]


def worker(src: str, fd: int, cell_timeout: float) -> int:
    """Inside the worker process: execute `src`, sending each executed cell as a JSON line on `fd`.

    `fd` is a pipe the kernel and the ranks never inherit, so nothing they do can
    write a result the grader reads.
    """
    os.set_inheritable(fd, False)
    _become_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))   # the grader's deadline: clean up below
    try:
        return _execute(src, fd, cell_timeout)
    finally:
        _kill_descendants()


def _execute(src: str, fd: int, cell_timeout: float) -> int:
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    channel = os.fdopen(fd, "w")
    nb = nbformat.read(src, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                            interrupt_on_timeout=True, resources={"metadata": {"path": str(Path(src).parent)}})
    note = ""
    try:
        client.reset_execution_trackers()
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                _truncate(cell)
                channel.write(json.dumps({"index": index, "cell": cell}) + "\n")
                channel.flush()
    except DeadKernelError as exc:
        note = f"the kernel died: {str(exc).splitlines()[0] if str(exc) else 'no message'}"
    except Exception as exc:  # noqa: BLE001 - recorded for the report
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    channel.write(json.dumps({"note": note}) + "\n")
    channel.close()
    return 0


def _become_subreaper() -> None:
    """Orphans below this process (a learner's daemon, double-forked or not) are re-parented here."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER (Linux)
    except (OSError, AttributeError):
        pass


def _kill_until_gone(find: Callable[[], list[psutil.Process]], after_round: Callable[[], None] | None = None) -> None:
    """SIGKILL what `find()` returns, round after round, until it returns nothing."""
    for _ in range(20):
        procs = find()
        if not procs:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=2)
        if after_round is not None:
            after_round()


def _reap_orphans() -> None:
    """Collect the exit status of orphans re-parented to us (we are a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_descendants() -> None:
    _kill_until_gone(lambda: psutil.Process().children(recursive=True), _reap_orphans)


def _limit_files() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))


def tagged_processes(token: str) -> list[psutil.Process]:
    """Every process that carries `token` in its environment (ours to stop)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TOKEN_VAR) == token:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out


def kill_token(token: str) -> None:
    """SIGKILL everything that carries `token`, until nothing does."""
    _kill_until_gone(lambda: tagged_processes(token))


def run_isolated(nb: nbformat.NotebookNode, workdir: Path, cell_timeout: float,
                 total_timeout: float, env: dict | None = None) -> tuple[nbformat.NotebookNode | None, str]:
    """Execute `nb` in a fresh worker; return (executed notebook or None, one-line note)."""
    src = workdir / "graded.ipynb"
    nbformat.write(nb, src)
    token = uuid.uuid4().hex
    child_env = dict(os.environ if env is None else env)
    child_env[TOKEN_VAR] = token
    child_env.setdefault("DISTLAB_RESULTS", str(workdir / "results"))
    child_env.setdefault("MPLBACKEND", "Agg")
    note, lines = "", []
    read_end, write_end = os.pipe()

    def reader() -> None:
        with os.fdopen(read_end, "r", errors="replace") as f:
            for line in f:
                lines.append(line)

    thread = threading.Thread(target=reader, daemon=True)
    with open(workdir / "worker.log", "wb") as log:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "distlab.grading.worker", str(src), str(write_end),
                                     str(cell_timeout)], cwd=workdir, env=child_env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    pass_fds=(write_end,), preexec_fn=_limit_files)
        finally:
            os.close(write_end)
        thread.start()
        try:
            proc.wait(timeout=total_timeout)
        except subprocess.TimeoutExpired:
            note = f"timed out: the notebook did not finish within {total_timeout:g} s"
            proc.terminate()          # the worker kills everything below it, then exits
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            kill_token(token)
            thread.join(timeout=10)
    executed, got = copy.deepcopy(nb), False
    for line in lines:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "index" in msg:
            executed.cells[msg["index"]] = nbformat.from_dict(msg["cell"])
            got = True
        elif "note" in msg:
            note = note or msg["note"]
    if not got:
        return None, note or f"the grading worker exited with code {proc.returncode} before running a cell"
    return executed, note


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
