"""The trusted runner: one per submission, inside its sandbox, runs every graded case.

    python -m distlab.grading.runner --result-fd W  < job (two messages: see `sandbox.job_lines`)

The grader starts it (in bubblewrap unless --no-sandbox) with a pipe; when
the grader runs as root, `--uid N` makes the runner drop to that unprivileged
uid (and gid, no groups) before anything else, so no process of the
submission holds root's access to host files; then it lowers its resource
limits (`limits`): processes, memory, file size, CPU. It writes its
records to W, one JSON object a line, and W is out of every rank's reach: the
fork server closes it before any rank exists, and the runner makes itself
non-dumpable first, so processes of the same user (the ranks) cannot open
its file descriptors or memory through /proc or ptrace. (A key to seal the
records would live in the same process, behind the same protection.)

A job may be a bundle: one hand-in's answers to several labs (`parts`), run one lab after the other in
the same sandbox (`distlab.grading.grade.run_together`); each case record names its lab and its part
(two parts may be the same lab: several hand-ins of one author, or a course's own test hand-ins).
For each task the lab grades, for each of its cases graded, it launches
`rankside.run_case` on the case's ranks with `distlab.launch` (one
forkserver for the whole submission; hangs end by the launcher's progress
detection, busy loops at the case's work cap, the notebook's livelock bound
computed in `grade.prepare`) and sends one record per case: the ranks' raw
outputs (safetensors bytes, never parsed here; the launcher's wrapper around
them is read by `plain_loads`), each rank's raw event stream, what each rank's broker booked
(`distlab.grading.broker`: started per case before the ranks, on gloo), or
why the case failed. After a hang, a busy loop or a case that ran past its
cap, a task's later cases are not run. Then a `done` record, and exit 0: the grader treats
anything else as a failed submission.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import selectors
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from typing import Any

import psutil

from distlab.engine import procs
from distlab.grading.broker import Brokers, read_exact
from distlab.grading.seccomp import no_dump

_STARTED = time.monotonic()
MAX_STREAM = 8 << 20     # bytes of audit events kept per rank and case


def _fork_server(close: tuple[int, ...]) -> None:
    """Start multiprocessing's fork server as a fork of this process.

    `distlab.launch` starts ranks from a fork server that imported torch once.
    The usual one is a fresh interpreter importing everything again (~7 s of
    CPU here); this process has already imported it all, so the server is
    forked from it instead. The child closes the result descriptor and stdin
    (`close`) first: ranks, forked from that child, inherit neither.
    """
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver
    # the resource tracker is a fresh interpreter (exec makes it dumpable again): its first act makes it
    # non-dumpable, or a rank (same uid) could write into its memory through /proc/<pid>/mem and run outside the
    # rank's seccomp filter
    spawn = util.spawnv_passfds

    def spawnv_passfds(path: str, args: list, passfds: Any) -> int:
        if args[-2] == "-c":
            args = [*args[:-1], "import ctypes; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); " + args[-1]]
        return spawn(path, args, passfds)
    util.spawnv_passfds = spawnv_passfds
    try:
        resource_tracker.ensure_running()
    finally:
        util.spawnv_passfds = spawn
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(alive_w)
            for fd in close:
                os.close(fd)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001 - the server's end; the launches report it
            code = 1
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


class _Streams:
    """Reads every rank's event FIFO while the case runs (a FIFO cannot be rewritten once read)."""

    def __init__(self, folder: str, world_size: int, more: list[int] = ()) -> None:
        """`more`: pipes read the same way after the ranks' FIFOs (the brokers' bookings), owned from now on."""
        self.paths = [os.path.join(folder, f"events{r}") for r in range(world_size)]
        self.fds = []
        for p in self.paths:
            os.mkfifo(p, 0o600)
            self.fds.append(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
        for fd in more:
            os.set_blocking(fd, False)
            self.fds.append(fd)
        self.data = [bytearray() for _ in self.fds]
        self.flooded = [False] * len(self.fds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        sel = selectors.DefaultSelector()
        for r, fd in enumerate(self.fds):
            sel.register(fd, selectors.EVENT_READ, r)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.05):
                self._drain(key.data)

    def _drain(self, r: int) -> None:
        while True:
            try:
                chunk = os.read(self.fds[r], 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            if len(self.data[r]) + len(chunk) > MAX_STREAM:
                self.flooded[r] = True
                return
            self.data[r] += chunk

    def close(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(timeout=5)
        for r in range(len(self.fds)):
            self._drain(r)
            os.close(self.fds[r])
        return [bytes(d) for d in self.data]


def _brokered(job: dict) -> bool:
    """Brokers own the real groups on gloo (CPU) ranks; NCCL's ranks keep theirs (traffic detected, not enforced)."""
    if job.get("backend") == "nccl":
        return False
    import torch
    return job.get("backend") == "gloo" or not torch.cuda.is_available()


def run_case(job: dict, task: Any, index: int, case: Any, folder: str) -> dict:
    """One launch of one case; a record for the grader (JSON-able, blobs in base64)."""
    from distlab.checks.verdict import reason
    from distlab.grading.rankside import run_case as on_rank
    from distlab.grading.safeload import plain_loads
    from distlab.engine.launch import LaunchOverran, LaunchStalled, LaunchTimeout, run_on_ranks
    from distlab.grading.secret import offer
    brokers = Brokers(folder, case.world_size) if _brokered(job) else None
    streams = _Streams(folder, case.world_size, [os.dup(fd) for fd in brokers.fds()] if brokers else [])
    record: dict[str, Any] = {"kind": "case", "task": task.name, "case": index, "world_size": case.world_size}
    offered: list[int] = []
    started = time.monotonic()
    try:
        inputs = (job.get("inputs") or {}).get(f"{task.name}/{index}")
        paths = [os.path.join(folder, f"inputs{r}") for r in range(case.world_size)] if inputs else None
        for r, path in enumerate(paths or []):     # each rank reads (and unlinks) its own before its group is up
            offered.append(offer(path, base64.b64decode(inputs[r])))
        outputs = run_on_ranks(on_rank, case.world_size,
                         args=(job["lab"], task.name, index, job["cells"], job["names"][task.name], streams.paths, job["cap_s"]),
                         kwargs=dict(input_paths=paths, stall_s=job["stall_s"],
                                     broker_paths=brokers.paths if brokers else None), backend=job["backend"],
                         stall=job["stall_s"], work_cap=(job.get("work_caps") or {}).get(f"{task.name}/{index}"),
                         timeout=job["cap_s"], loads=plain_loads)
        if not all(isinstance(o, bytes) for o in outputs):
            raise TypeError("a rank returned something other than its outputs (safetensors bytes)")
        record.update(status="ok", outputs=[base64.b64encode(o).decode() for o in outputs])
    except Exception as exc:  # noqa: BLE001 - every failure is a line of the report
        stuck = "hung" if isinstance(exc, LaunchStalled) else "never finished" if isinstance(exc, LaunchOverran) \
            else "ran past the cap" if isinstance(exc, LaunchTimeout) else ""
        why = reason(exc, task.hang_hint)
        if isinstance(exc, LaunchOverran):       # a busy loop: how long the learner waited for this line
            why = f"{why} (stopped {time.monotonic() - started:.0f} s after the case started)"
        record.update(status="error", reason=why, stuck=stuck)
    for fd in offered:
        os.close(fd)
    if brokers:
        brokers.stop()
    raw, n = streams.close(), case.world_size
    record["streams"] = [base64.b64encode(s).decode() for s in raw[:n]]
    record["flooded"] = streams.flooded[:n]
    if brokers:     # what each rank's broker booked: the case's traffic
        record["brokers"] = [base64.b64encode(s).decode() if not f else "" for s, f in zip(raw[n:], streams.flooded[n:])]
        brokers.close()
    return record


class _Capped:
    """stdout/stderr of the runner (its log): ranks' output is replayed here, so keep only the first MiB."""

    def __init__(self, stream: Any, limit: int = 1 << 20) -> None:
        self.stream, self.left = stream, limit

    def write(self, text: str) -> int:
        if self.left > 0:
            piece = text[: self.left]
            self.left -= len(piece)
            try:
                self.stream.write(piece if self.left > 0 else piece + "\n[... log truncated]\n")
            except OSError:
                self.left = 0
        return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            pass


def drop_to(uid: int) -> None:
    """Become `uid` (gid the same, no supplementary groups) for good; refuse to go on as root."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit("distlab grade: the runner could not drop root")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise SystemExit("distlab grade: the runner could take root back")


def limits(job: dict) -> None:
    """Per-process limits every rank inherits (see `distlab.grading.sandbox.Limits`)."""
    import resource
    want = {resource.RLIMIT_NPROC: job.get("max_procs"), resource.RLIMIT_DATA: job.get("max_memory"),
            resource.RLIMIT_CPU: job.get("max_cpu_s"), resource.RLIMIT_NOFILE: job.get("max_files")}
    for which, value in want.items():
        if not value:
            continue
        value = int(value)
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY and hard < value:
            value = hard
        resource.setrlimit(which, (value, value))


def read_message(fd: int) -> Any:
    """One message from `fd`: its length (a line), then that many bytes of JSON; read unbuffered, so nothing of
    the next message is in this process's memory yet."""
    digits = b""
    while not digits.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte or len(digits) > 20:
            raise SystemExit("distlab grade: the runner's job was cut off")
        digits += byte
    try:
        return json.loads(read_exact(fd, int(digits)))
    except EOFError:
        raise SystemExit("distlab grade: the runner's job was cut off") from None


def _send(fd: int, record: dict) -> None:
    """One record to the grader: a line of JSON (which holds no raw newline)."""
    data = memoryview(json.dumps(record).encode() + b"\n")
    while data:
        data = data[os.write(fd, data):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlab.grading.runner")
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--uid", type=int, default=None)
    args = ap.parse_args(argv)
    if args.uid is not None:
        drop_to(args.uid)
    from distlab.checks import lab_module
    from distlab.checks.task import later_cases_reason
    from distlab.engine.launch import _PRELOAD
    job = read_message(0)      # the job, without the ranks' secret inputs (`sandbox.job_lines`)
    limits(job)
    # a bundle: one hand-in's answers to several labs (`parts`), each part a lab's job, run in turn
    parts = [{**job, **part} for part in job.get("parts") or [job]]
    # imported here, the ranks (forked from the fork server) have them too
    modules = [lab_module(part["lab"]) for part in parts]
    # what the ranks would otherwise import again on every launch: each lab's own list, else the launcher's
    preload = dict.fromkeys(name for module in modules for name in getattr(module, "RANK_IMPORTS", _PRELOAD))
    for name in (*preload, "distlab.grading.rankside", "distlab.grading.safeload", "distlab.checks.verdict"):
        __import__(name)
    # before the fork server starts: it, and every rank it forks, is non-dumpable too (a rank, same uid, could
    # otherwise write into the fork server's memory through /proc/<pid>/mem and fork outside its seccomp filter)
    no_dump()
    _fork_server((args.result_fd, 0))
    sys.stdout, sys.stderr = _Capped(sys.stdout), _Capped(sys.stderr)
    procs.become_subreaper()   # without a sandbox, a rank's orphans come back here to be stopped
    # the ranks' secret inputs, read only now: the fork server (and every rank and broker it forks) never held them
    for part, inputs in zip(parts, read_message(0)):
        part["inputs"] = inputs
    os.set_inheritable(args.result_fd, False)
    print(f"distlab grade: runner up in {time.monotonic() - _STARTED:.1f} s", file=sys.stderr, flush=True)
    send = partial(_send, args.result_fd)
    work = tempfile.mkdtemp(prefix="distlab-runner-")
    for k, (part, module) in enumerate(zip(parts, modules)):
        for name, indices in part["tasks"]:
            task = module.TASKS[name]
            skip = ""
            cases = task.cases()
            for index in indices:
                case = cases[index]
                if skip:
                    rec = {"kind": "case", "task": name, "case": index, "world_size": case.world_size,
                           "status": "error", "reason": skip, "streams": [], "flooded": []}
                else:
                    folder = os.path.join(work, f"{k}-{part['lab']}-{name}-{index}")
                    os.mkdir(folder)
                    started = time.monotonic()
                    rec = run_case(part, task, index, case, folder)
                    print(f"distlab grade: {name}, {case.world_size} ranks: {rec['status']} in "
                          f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
                    skip = later_cases_reason(case.world_size, rec.get("reason", ""), rec.get("stuck", "")) or ""
                rec["lab"], rec["part"] = part["lab"], k
                send(rec)
    procs.kill_until_gone(lambda: psutil.Process().children(recursive=True), procs.reap_orphans)
    shutil.rmtree(work, ignore_errors=True)
    import resource
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_s = sum(u.ru_utime + u.ru_stime for u in usage)    # the ranks, reaped by the fork server, included
    send({"kind": "done", "cpu_s": round(cpu_s, 2)})
    return 0


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown (torch's atexit work, module finalisation: seconds of a busy
    machine per submission, after everything was sent and every child stopped)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
