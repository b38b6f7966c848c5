"""Running one submission's runner in a bubblewrap sandbox, and reading what it sends back.

`run(job, ...)` starts `python -I -m distlab.grading.runner` (see there) and
returns the records it sent on its result pipe, or a one-line reason. By default on
Linux the runner runs inside `bwrap` (`argv()`):

- its own PID, IPC, UTS and network namespaces: the grader's processes are
  invisible, only loopback exists (enough for gloo);
- a real unprivileged uid: run by an ordinary account, uid 65534 in its own
  user namespace (the account's own uid outside); run as root, bwrap keeps no
  user namespace (inside one, uid 65534 would still be root outside) and the
  runner drops to a uid of its own (`UID_BASE` + a slot per concurrent
  submission) before anything else, so host files such as /etc/shadow are
  unreadable;
- resource limits per process (`Limits`): processes and threads (per uid, so
  per submission), memory (RLIMIT_DATA), CPU seconds, file size; and per
  submission, memory: this process adds up the private resident memory of
  the submission's whole process tree twice a second and stops it past the
  same limit (the kernel offers no per-submission memory limit without
  cgroups, which an instructor's account rarely may create);
- a filesystem that holds only the system directories, the Python
  environment and the `distlab` package, all read-only: no `solutions/`, no
  `labs/`, no grader files, no other submission; a private `/tmp`;
- GPU device nodes bound through when present (NCCL stays usable);
- when the runner exits, the namespace's init exits and the kernel kills
  every process left inside it: a learner's daemon or fork bomb included.

Without the sandbox (`--no-sandbox`, or bwrap missing) the runner still
judges nothing itself, but learner code
can read whatever the instructor's account can and reach the network.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distlab.engine import procs

MAX_FILE_BYTES = 64 << 20           # RLIMIT_FSIZE for everything in the sandbox (ranks' output floods)
MAX_RESULT_BYTES = 256 << 20        # all records of one submission: past it the runner is stopped at once
UID_BASE = 61000                    # run as root: the runner of concurrent submission k becomes UID_BASE + k
TMP_BYTES = 2 << 30                 # the sandbox's private /tmp and /dev/shm (each), before `sized` sets them
TOKEN_VAR = "DISTLAB_GRADE_TOKEN"   # marks processes to stop when running without a sandbox
# Passed into the sandbox: every DISTLAB_* setting (a task's cases may depend on one, and the grader computed
# the references with the same ones), and these.
_ENV_KEEP = ("CUDA_VISIBLE_DEVICES", "LANG", "OMP_NUM_THREADS")


def bwrap_path() -> str | None:
    """The bwrap executable, when this is Linux and it is installed."""
    return shutil.which("bwrap") if sys.platform.startswith("linux") else None


def _read_only_roots() -> list[str]:
    """The Python environment and the distlab package (where its source lives, editable or not)."""
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, paths["stdlib"], paths["purelib"],
                                           paths["platlib"])}
    roots.add(os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir)))   # the distlab package
    roots.add(os.path.realpath(os.path.dirname(sys.executable)))
    # nothing under /usr needs its own bind; keep only the outermost of nested roots
    out = sorted(r for r in roots if not r.startswith("/usr/"))
    return [r for r in out if not any(r != o and r.startswith(o + os.sep) for o in out)]


@dataclass(frozen=True)
class Limits:
    """Resource limits of one submission's processes (0: none)."""

    procs: int = 512                 # processes + threads of its uid (a fork or thread bomb stops here)
    memory_bytes: int = 6 << 30      # RLIMIT_DATA of each process (heap and anonymous mappings: tensors), and
                                     # the private resident memory of all its processes together (`_tree_bytes`)
                                     # with what its /tmp and /dev/shm hold (each tmpfs sized to it: `sized`)
    cpu_s: float = 0.0               # RLIMIT_CPU of each process; 0: the submission cap

    def job(self, cap_s: float) -> dict:
        procs = self.procs
        if procs and not as_root():     # RLIMIT_NPROC counts every process of the uid: the account's own too
            procs += _own_processes()
        return {"max_procs": procs, "max_memory": self.memory_bytes, "max_cpu_s": int(self.cpu_s or cap_s)}


def _own_processes() -> int:
    """Processes and threads of this account now (what RLIMIT_NPROC counts besides the submission's)."""
    import psutil
    uid, count = os.getuid(), 0
    for p in psutil.process_iter(["uids", "num_threads"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid:
                count += p.info["num_threads"] or 1
        except (psutil.Error, TypeError):
            pass
    return count


def as_root() -> bool:
    return os.geteuid() == 0


def _parents(paths: list[str]) -> list[str]:
    """Every folder above `paths` (outermost first): bwrap would create them 0700 when run as root."""
    out: list[str] = []
    for p in paths:
        parts = p.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/" + "/".join(parts[:i])
            if d not in out:
                out.append(d)
    return out


def argv(user_ns: bool = True) -> list[str]:
    """The bwrap command line that wraps the runner (see the module docstring)."""
    cmd = [bwrap_path() or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if as_root():     # the runner drops to an unprivileged uid itself (run(..., uid=...))
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    elif user_ns:
        cmd += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    # The private /tmp first, the environment and package after it: a checkout or venv that lives
    # under /tmp is bound on top of the empty tmpfs (mounted later, the tmpfs would hide it).
    cmd += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
            "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/dev/shm"]
    roots = _read_only_roots()
    for parent in _parents(roots):
        # /usr and /etc are bound read-only above (their folders exist); /tmp is the tmpfs, whose own folders
        # (a checkout or venv under /tmp, as CI's clone) must be made 0755 like any other.
        if parent != "/tmp" and not any(parent == top or parent.startswith(top + "/") for top in ("/usr", "/etc")):
            cmd += ["--perms", "0755", "--dir", parent]
    for root in roots:
        cmd += ["--ro-bind", root, root]
    gpus = gpu_nodes()
    for node in gpus:
        cmd += ["--dev-bind", node, node]
    if gpus:
        cmd += ["--ro-bind-try", "/sys", "/sys", "--ro-bind-try", "/run/nvidia-persistenced",
                "/run/nvidia-persistenced"]
    cmd += ["--chdir", "/tmp", "--clearenv"]
    for key, value in _env("/tmp").items():
        cmd += ["--setenv", key, value]
    return cmd


def sized(cmd: list[str], memory_bytes: int) -> list[str]:
    """The bwrap argv with its tmpfs (/tmp, /dev/shm) sized to the submission's memory limit: files there
    are memory, and what they hold counts against that limit (`_wait`), so neither can hold more."""
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg == "--size" and memory_bytes:
            out[i + 1] = str(max(16 << 20, int(memory_bytes)))
    return out


def hidden(lab: str | list[str], folder: str) -> list[str]:
    """bwrap arguments that hide the package's answers to `lab` (`shortcuts.HIDDEN`; a list: to each of those
    labs): each module's source is bound over by a copy whose answer functions raise (written to `folder`),
    and its compiled copies by empty files. Reading the file, importing or reloading the module inside the
    sandbox finds no answer."""
    import ast
    import importlib.util

    from distlab.grading.shortcuts import HIDDEN
    out: list[str] = []
    hide: dict[str, set[str]] = {}
    for one in [lab] if isinstance(lab, str) else lab:
        for module, names in HIDDEN.get(one, ()):
            hide.setdefault(module, set()).update(names)
    for module, names in hide.items():
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            continue
        source = Path(spec.origin).read_text()
        tree = ast.parse(source)
        lines = source.splitlines(keepends=True)
        for node in sorted((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names),
                           key=lambda n: -n.lineno):
            body = node.body[0].end_lineno if ast.get_docstring(node) else node.lineno
            indent = " " * (node.body[0].col_offset)
            lines[body:node.end_lineno] = [f"{indent}raise NotImplementedError('hidden while grading: "
                                           f"this lab asks you to write it')\n"]
        copy = Path(folder) / f"{module}.py"
        copy.write_text("".join(lines))
        out += ["--ro-bind", str(copy), os.path.realpath(spec.origin)]
        for cached in glob.glob(os.path.join(os.path.dirname(spec.origin), "__pycache__",
                                             Path(spec.origin).stem + ".*")):
            out += ["--ro-bind", "/dev/null", os.path.realpath(cached)]
    return out


def gpu_nodes() -> list[str]:
    """The NVIDIA device nodes to pass through. The driver creates /dev/nvidia-uvm (and -uvm-tools) on the
    first CUDA call of any process; a grader that has made none would bind only /dev/nvidia0 and
    /dev/nvidiactl, and CUDA inside the sandbox (which may not create nodes) would find no device. So where
    the driver is present and uvm is not, one short CUDA call in a child process creates it first."""
    if os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/nvidia-uvm"):
        try:
            subprocess.run([sys.executable, "-c", "import torch; torch.cuda.is_available() and torch.cuda.init()"],
                           timeout=120, capture_output=True, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    return sorted(glob.glob("/dev/nvidia*"))


def _env(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or (k.startswith("DISTLAB_") and k != TOKEN_VAR
                                                                      and k != "DISTLAB_RESULTS")}
    # a `record(...)` in an answer cell writes into the sandbox's own home, never the course checkout
    env.update(HOME=home, TMPDIR=home, DISTLAB_RESULTS=os.path.join(home, "results"),
               PATH="/usr/local/bin:/usr/bin:/bin", MPLBACKEND="Agg",
               TORCH_CPP_LOG_LEVEL="ERROR", PYTHONDONTWRITEBYTECODE="1", MPLCONFIGDIR=home)
    return env


def works(user_ns: bool = True) -> bool:
    """Whether bwrap can start a sandbox here (user namespaces may be disabled)."""
    try:
        return subprocess.run(argv(user_ns) + ["--", sys.executable, "-I", "-c", "pass"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limits() -> None:
    """In the child, before exec: cap every file a sandboxed process writes; no core dumps."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class Outcome:
    """What the runner sent (its records, in order) and, if it failed, why (one line)."""

    records: list[dict] = field(default_factory=list)
    failure: str = ""
    seconds: float = 0.0
    cpu_s: float = 0.0          # CPU seconds of the runner, its fork server and every rank (when it finished)
    peak_bytes: int = 0         # the most private resident memory its processes held together (sampled)


_slots: set[int] = set()
_slots_lock = threading.Lock()


def _take_slot() -> int:
    with _slots_lock:
        k = next(i for i in range(len(_slots) + 1) if i not in _slots)
        _slots.add(k)
        return k


def _give_slot(k: int) -> None:
    with _slots_lock:
        _slots.discard(k)


def run(job: dict, *, sandbox: list[str] | None, cap_s: float, log: Path,
        on_record: Callable[[dict], None] | None = None, limits: Limits | None = None,
        max_result_bytes: int = MAX_RESULT_BYTES) -> Outcome:
    """Run the runner on `job` (inside `sandbox`, a bwrap argv, or directly when None)."""
    slot = _take_slot()
    try:
        return _run(job, sandbox=sandbox, cap_s=cap_s, log=log, on_record=on_record, slot=slot,
                    limits=limits or Limits(), max_result_bytes=max_result_bytes)
    finally:
        _give_slot(slot)


def _run(job: dict, *, sandbox: list[str] | None, cap_s: float, log: Path, on_record: Callable[[dict], None] | None,
         slot: int, limits: Limits, max_result_bytes: int) -> Outcome:
    start = time.monotonic()
    res_r, res_w = os.pipe()
    cmd = [sys.executable, "-I", "-B", "-m", "distlab.grading.runner", "--result-fd", str(res_w)]
    workdir = None
    if sandbox is not None:
        if "--cap-add" in sandbox:      # bwrap run as root (see argv): the runner drops to its own uid
            cmd += ["--uid", str(UID_BASE + slot)]
        job = {**job, **limits.job(cap_s)}
        workdir = tempfile.mkdtemp(prefix="distlab-hidden-")
        labs = [part.get("lab", "") for part in job.get("parts") or [job]]
        cmd = sized(sandbox, limits.memory_bytes) + hidden(labs, workdir) + ["--"] + cmd
        cwd, env = "/", None
    else:
        workdir = tempfile.mkdtemp(prefix="distlab-grade-")
        cwd, env = workdir, _env(workdir) | {TOKEN_VAR: uuid.uuid4().hex}
    received = bytearray()
    out = Outcome()
    with open(log, "wb") as logf:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, cwd=cwd,
                                    env=env, pass_fds=(res_w,), start_new_session=True, preexec_fn=_limits)
        finally:
            os.close(res_w)
        overflow = threading.Event()
        reader = threading.Thread(target=_pump, args=(res_r, received, on_record, max_result_bytes,
                                                      overflow), daemon=True)
        reader.start()
        feeder = threading.Thread(target=_feed, args=(proc, job_lines(job)), daemon=True)
        feeder.start()      # a thread: the runner reads its job only after importing torch
        try:
            code = _wait(proc, cap_s, overflow, limits.memory_bytes, out, tmpfs=sandbox is not None)
            if out.failure:
                code = None
            elif overflow.is_set():
                code = None
                out.failure = (f"its ranks sent more than {max_result_bytes >> 20} MiB of results: stopped "
                               "at once, not graded")
            elif code is None:
                out.failure = (f"stopped after {cap_s:g} s (the last-resort cap on one submission): "
                               "its ranks kept working without finishing")
        finally:
            _stop(proc, env.get(TOKEN_VAR) if env else None)
            reader.join(timeout=30)
            os.close(res_r)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
    out.records, malformed = records_of(bytes(received))
    done = bool(out.records) and out.records[-1].get("kind") == "done"
    if done and isinstance(out.records[-1].get("cpu_s"), (int, float)):
        out.cpu_s = float(out.records[-1]["cpu_s"])
    if not out.failure and (code != 0 or not done):
        out.failure = f"the grading runner {_exit_words(code)} before it finished: a rank may have killed it"
    if malformed and not out.failure:
        out.failure = "the runner's results were malformed: not graded"
    out.seconds = time.monotonic() - start
    return out


def _wait(proc: subprocess.Popen, cap_s: float, overflow: threading.Event, memory_bytes: int = 0,
          out: Outcome | None = None, tmpfs: bool = False) -> int | None:
    """The runner's exit code; None when it ran past `cap_s`, its results overflowed, or its processes together
    (with its sandbox's /tmp and /dev/shm when `tmpfs`) held more than `memory_bytes` (then `out.failure` says
    so); the caller stops it."""
    deadline, sample = time.monotonic() + cap_s, 0
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if overflow.is_set() or time.monotonic() >= deadline:
                return None
        sample += 1
        if memory_bytes and out is not None and sample % 2 == 0:
            held = _tree_bytes(proc.pid, tmpfs)
            out.peak_bytes = max(out.peak_bytes, held)
            if held > memory_bytes:
                out.failure = (f"its processes{' and its /tmp and /dev/shm' if tmpfs else ''} together held "
                               f"{held / (1 << 30):.2f} GiB, past the submission's memory limit "
                               f"({memory_bytes / (1 << 30):g} GiB, --max-memory): stopped, not graded")
                return None


def _tree_bytes(pid: int, tmpfs: bool = False) -> int:
    """Private resident memory of `pid` and every process below it: each one's resident set less its
    file-backed and shared pages (/proc/PID/statm; cheap enough to sample twice a second). Pages a rank
    still shares copy-on-write with the fork server count in each: an overcount of at most the fork
    server's own heap per rank, never an undercount. With `tmpfs`, plus what the sandbox's /tmp and
    /dev/shm hold (RAM-backed files, read through a process inside it: /proc/PID/root)."""
    import psutil
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = _tmpfs_bytes([p.pid for p in tree[1:]]) if tmpfs else 0
    for p in tree:
        try:
            m = p.memory_info()
            total += max(0, m.rss - getattr(m, "shared", 0))
        except psutil.Error:
            pass
    return total


def _tmpfs_bytes(pids: list[int]) -> int:
    """Bytes held in /tmp and /dev/shm as the first of `pids` whose root is not this machine's sees them."""
    host = os.stat("/")
    for pid in pids:
        base = f"/proc/{pid}/root"
        try:
            st = os.stat(base)
            if (st.st_dev, st.st_ino) == (host.st_dev, host.st_ino):
                continue
            return sum((v.f_blocks - v.f_bfree) * v.f_frsize for v in (os.statvfs(base + "/tmp"),
                                                                       os.statvfs(base + "/dev/shm")))
        except OSError:
            continue
    return 0


def job_lines(job: dict) -> bytes:
    """The runner's stdin: the job without the ranks' secret inputs, then each part's inputs, each as its length
    (a line) and its JSON. The runner reads exactly the first (`runner.read_message`), forks the ranks' fork
    server, then reads the second: no rank inherits another rank's inputs."""
    parts = job.get("parts") or [job]
    bare = {**job, "parts": [{**p, "inputs": None} for p in parts]} if "parts" in job else {**job, "inputs": None}
    first, second = json.dumps(bare).encode(), json.dumps([p.get("inputs") for p in parts]).encode()
    return b"%d\n" % len(first) + first + b"%d\n" % len(second) + second


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except OSError:
        pass    # the runner died before reading its job: its exit code says why


def _exit_words(code: int | None) -> str:
    """'was killed by SIGKILL' for -9 (a direct child) or 137 (bwrap reports its child's signal so)."""
    sig = -code if code is not None and code < 0 else code - 128 if code is not None and 128 < code < 160 else 0
    try:
        return f"was killed by {signal.Signals(sig).name}" if sig else f"exited with code {code}"
    except ValueError:
        return f"exited with code {code}"


def records_of(data: bytes) -> tuple[list[dict], bool]:
    """The runner's records (a JSON object a line), and whether any complete line was not one."""
    out, malformed = [], False
    for line in data.split(b"\n")[:-1]:      # the last piece: an unfinished line (the runner was stopped)
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if type(rec) is dict:
            out.append(rec)
        else:
            malformed = True
    return out, malformed


def _pump(fd: int, into: bytearray, on_record: Callable[[dict], None] | None,
          max_bytes: int = MAX_RESULT_BYTES, overflow: threading.Event | None = None) -> None:
    """Collect the runner's bytes (at most `max_bytes`: past it, set `overflow` and stop reading); hand each
    record to `on_record` as it arrives."""
    seen = 0
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except OSError:
            return
        if not chunk:
            return
        if len(into) + len(chunk) > max_bytes:
            if overflow is not None:
                overflow.set()
            return
        into += chunk
        if on_record is not None:
            end = into.rfind(b"\n") + 1
            for rec in records_of(bytes(into[seen:end]))[0]:
                try:
                    on_record(rec)
                except Exception:  # noqa: BLE001 - progress printing must not stop grading
                    pass
            seen = end


def _stop(proc: subprocess.Popen, token: str | None) -> None:
    """Nothing of this submission keeps running: its tree, its session, anything carrying its token."""
    procs.kill_tree([proc.pid])
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if token:
        procs.kill_until_gone(lambda: _tagged(token))


def _tagged(token: str) -> list:
    import psutil
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TOKEN_VAR) == token:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out
