"""Run a function on N ranks from a notebook, a script or a test.

    import distlab
    def hello():
        return distlab.rank() * 10
    distlab.launch(hello, 4)          # -> [0, 10, 20, 30]

Each rank is a process (torch.multiprocessing, forkserver with torch preloaded,
so only the first launch pays for importing torch). The function travels with
cloudpickle, so functions and classes defined in notebook cells work. The
backend is NCCL with one GPU per rank when there are enough GPUs, else gloo on
the CPU. Each rank's output is captured and replayed here in rank order.

Slow is not hung. While ranks run, the launcher watches their CPU time: a
rank that computes or moves bytes is working, however slow the machine; when
no unfinished rank has done any work for `stall` seconds, they are waiting
for each other forever (a collective some ranks skip, a recv without a
send). Then each stuck rank's Python stack is read (faulthandler) and the
launch raises `LaunchStalled`, which says where each rank waits. The
opposite, a rank busy forever (a loop whose counter never moves), is a
livelock: `run_on_ranks(..., work_cap=s)` stops a launch in which one rank
has used more than `s` seconds of CPU and raises `LaunchOverran`, with the
same stacks. `timeout` is only a last-resort cap on the whole launch.

Failures come back as `RankFailed` / `LaunchStalled` / `LaunchOverran` /
`LaunchTimeout`, and no process is left behind in any case, Jupyter's
interrupt included.

A fault on purpose: `run_on_ranks(..., fault=(1, "step 7"))` arms rank 1 at
the point its code names with `fault_point("step", 7)`. When rank 1 gets
there it tells the launcher and waits; the launcher SIGKILLs it from outside
(a process killed by the kernel, as an out-of-memory killer or a lost node
would: no Python cleanup, no error report), stops every other rank and raises
`FaultInjected`, which names the rank and the point.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist

from distlab.engine import procs
from distlab.engine.libpaths import library_roots
from distlab.engine import runtime as _runtime
from distlab.engine import strict as _strict
from distlab.engine import watchdog as _watchdog

BACKENDS = ("auto", "nccl", "gloo")
# A last resort only: hangs are found by lack of progress (`stall`), not by the clock.
DEFAULT_TIMEOUT_S = 4 * 3600.0
# Seconds without any work on any unfinished rank before a launch counts as stuck.
# A GPU rank may wait for its device with the CPU idle, so NCCL waits longer.
DEFAULT_STALL_S = {"gloo": 10.0, "nccl": 60.0}
_said_cpu_fallback = False


def default_stall(backend: str) -> float:
    """The stall window: $DISTLAB_STALL_S if set, else 10 s on gloo and 60 s on NCCL."""
    env = os.environ.get("DISTLAB_STALL_S")
    return float(env) if env else DEFAULT_STALL_S.get(backend, 10.0)


class LaunchError(RuntimeError):
    """Base class: something went wrong while running ranks."""


class RankFailed(LaunchError):
    """A rank raised. `rank` says which; `traceback` is its traceback text."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str, others: str = ""):
        self.rank, self.exc_type, self.traceback = rank, exc_type, traceback
        text = f"rank {rank} raised {exc_type}: {message}"
        if others:
            text += f"\n(the other ranks were stopped; {others})"
        text += f"\n--- traceback on rank {rank} ---\n{traceback.rstrip()}"
        super().__init__(text)


class FaultInjected(LaunchError):
    """The launcher killed rank `rank` at `point` because `run_on_ranks(fault=...)` asked it to."""

    def __init__(self, rank: int, point: str, others: list[int]):
        self.rank, self.point, self.others = rank, point, list(others)
        stopped = f"the other ranks {others} were stopped" if others else "no other rank was still running"
        super().__init__(
            f"rank {rank} was killed with SIGKILL at {point}: a fault injected by the launcher "
            f"(run_on_ranks(fault=({rank}, {point!r}))), not an error in the rank's code; {stopped}. "
            "Nothing the killed rank held in memory survives: a run that saved checkpoints resumes from the "
            "newest complete one.")


class LaunchTimeout(LaunchError):
    """Some ranks did not finish in time. `ranks` lists them."""

    def __init__(self, ranks: list[int], timeout_s: float, message: str | None = None):
        self.ranks = ranks
        self.timeout_s = timeout_s
        super().__init__(message or (
            f"rank(s) {ranks} did not finish within {timeout_s:g} s and were stopped "
            "(they were still working: pass a larger timeout= if the job is just long)."))


class LaunchStalled(LaunchTimeout):
    """Every unfinished rank waited `stall_s` seconds without doing any work.

    `ranks` lists them; `stacks[r]` is where rank r was waiting (its Python
    stack, innermost call last), `where[r]` the innermost line of it that is the
    learner's, `calls[r]` the torch.distributed function it waits in ("recv",
    "broadcast"; "" when none shows); `finished` the ranks that had returned.
    """

    def __init__(self, ranks: list[int], stall_s: float, stacks: dict[int, str], finished: list[int],
                 notes: dict[int, str] | None = None, detail: dict[int, str] | None = None):
        self.stacks, self.finished = stacks, list(finished)
        self.detail = detail or {}
        self.where = {r: _innermost(stacks.get(r, "")) for r in ranks}
        self.calls = {r: _c10d_call(stacks.get(r, "")) for r in ranks}
        self.notes = notes or {}
        lines = [f"rank(s) {ranks} waited {stall_s:g} s without doing any work: they wait for "
                 "each other forever, and were stopped." if not self.detail else
                 f"rank(s) {ranks} waited {stall_s:g} s (the stall window) for an operation that never completed, "
                 "and were stopped."]
        for r in ranks:
            lines.append(f"  rank {r} is stuck at {self.where[r] or 'an unknown place'}"
                         + (f", inside dist.{self.calls[r]}" if self.calls[r] else "")
                         + (f" (it was doing: {self.notes[r]})" if self.notes.get(r) else ""))
            if self.detail.get(r):
                lines.append(f"    {self.detail[r]}")
        if finished:
            lines.append(f"  rank(s) {finished} had already returned.")
        lines.append("A collective (or a recv) that not every rank reaches in the same order waits forever: "
                     "check that every send has a matching recv on its peer, and that all ranks call the same "
                     "collectives with the same sizes.")
        super().__init__(ranks, stall_s, "\n".join(lines))


class LaunchOverran(LaunchTimeout):
    """A rank kept working past the launch's `work_cap` (CPU seconds): a livelock, busy but never done.

    Like `LaunchStalled`: `ranks` lists the unfinished ranks, `stacks[r]` is a
    sample of rank r's Python stack when it was stopped, `where[r]` its
    innermost line of the learner's code, `notes[r]` the rank's last
    `progress` note; `cpu_s[r]` the CPU seconds it had used.
    """

    def __init__(self, ranks: list[int], work_cap_s: float, stacks: dict[int, str], finished: list[int],
                 notes: dict[int, str] | None = None, cpu_s: dict[int, float] | None = None):
        self.stacks, self.notes, self.cpu_s, self.finished = stacks, notes or {}, cpu_s or {}, list(finished)
        self.where = {r: _innermost(stacks.get(r, "")) for r in ranks}
        lines = [f"rank(s) {ranks} were still working after {work_cap_s:g} s of CPU time, far more than the "
                 "job needs: a loop that never ends (livelock), so they were stopped."]
        for r in ranks:
            lines.append(f"  rank {r} was at {self.where[r] or 'an unknown place'}"
                         + (f" (it was doing: {self.notes[r]})" if self.notes.get(r) else ""))
        if finished:
            lines.append(f"  rank(s) {finished} had already returned.")
        lines.append("Check that every loop's condition changes: a step counter that is never increased, "
                     "a `while` that waits for a value no rank sets.")
        super().__init__(ranks, work_cap_s, "\n".join(lines))


def cell_name(path: str) -> str:
    """How the learner sees the file a frame ran in: `cell [13]` for a notebook cell this kernel ran (its
    execution count), the grader's `answer cell ...` as it is, else the file's base name."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
        count = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(path)
    except Exception:  # noqa: BLE001 - no IPython, or one without the map: fall back to the file name
        count = None
    if count is not None:
        return f"cell [{count}]"
    if path.startswith("<") and path.endswith(">"):
        return path[1:-1]
    return "a notebook cell" if "ipykernel" in path else os.path.basename(path)


def place(path: str, lineno: int | str, fn: str = "") -> str:
    """'fn (cell [13], line 9: `source line`)': a frame as the learner sees it (the source line when this
    process can read it, as a kernel can its own cells)."""
    import linecache
    text = linecache.getline(path, int(lineno)).strip() if str(lineno).isdigit() else ""
    text = text if len(text) <= 80 else text[:77] + "..."
    where = f"{cell_name(path)}, line {lineno}" + (f": `{text}`" if text else "")
    return f"{fn} ({where})" if fn else where


def _frames(stack: str) -> list[tuple[str, str, str]]:
    """(path, line, function) of each frame of a faulthandler dump, innermost first."""
    frames = []
    for line in stack.splitlines():
        line = line.strip()
        if not line.startswith("File "):
            continue
        try:   # File "path", line N in fn
            _, path, rest = line.split('"', 2)
            lineno = rest.split("line", 1)[1].split()[0]
            fn = rest.rsplit(" in ", 1)[-1].strip()
        except (ValueError, IndexError):
            continue
        frames.append((path, lineno, fn))
    return frames


def _c10d_call(stack: str) -> str:
    """The torch.distributed function a rank waits in ('recv', 'all_reduce'), from its stack dump; ''."""
    for path, _, fn in _frames(stack):
        if path.endswith("distributed_c10d.py") and not fn.startswith("_"):
            return fn
    return ""


# Library code: a rank sampled inside `contextlib` (batch_isend_irecv's coalescing manager), `threading`,
# `multiprocessing` or an installed package is still at the learner's line that called it.
_LIBRARY_ROOTS = library_roots()[0]
_LIBRARY = (os.sep + "torch" + os.sep, os.sep + "distlab" + os.sep,
            os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _library(path: str) -> bool:
    """Whether a frame's file is library code (torch, distlab, any installed package, Python's standard
    library, the fork server's own `-c` code) rather than the learner's."""
    if path == "<string>" or path.startswith("<frozen"):
        return True
    return any(e in path for e in _LIBRARY) or os.path.realpath(path).startswith(_LIBRARY_ROOTS)


def _innermost(stack: str) -> str:
    """'fn (cell [13], line 9: `source`)' of the innermost frame of a faulthandler dump that is the
    learner's own (not torch's, not distlab's), with its caller when that is the learner's too; else
    the innermost distlab frame."""
    frames = _frames(stack)
    # faulthandler prints the innermost frame first.
    mine = [(path, lineno, fn) for path, lineno, fn in frames if not _library(path)]
    if mine:
        # A small helper of the learner's (a `p2p` that posts and waits) is where the rank waits, its caller
        # is the line to fix: name both.
        text = place(*mine[0])
        if len(mine) > 1 and mine[1][2] != mine[0][2]:
            text += f", called from {place(*mine[1])}"
        return text
    for path, lineno, fn in frames:
        if os.sep + "distlab" + os.sep in path:
            return f"{fn} ({os.path.basename(path)}, line {lineno})"
    return ""


# The armed fault of this launch, as the ranks see it: {"rank": r, "point": "step 7", "file": path}.
FAULT_ENV = "DISTLAB_FAULT"
# How long an armed rank waits at its fault point for the launcher's SIGKILL before it gives up.
FAULT_WAIT_S = 60.0


def fault_label(name: str, index: int | None = None) -> str:
    """'step 7': how a fault point is named in `run_on_ranks(fault=(rank, label))` and in the error."""
    return name if index is None else f"{name} {index}"


def fault_point(name: str, index: int | None = None) -> None:
    """A place in a rank's code where the launcher may inject a fault: `fault_point("step", step)`.

    Does nothing unless this launch armed this rank at this point (`run_on_ranks(fault=(rank, "step 7"))`).
    Then the rank writes a file the launcher watches, and waits: the launcher kills it from outside with
    SIGKILL, so it dies the way a real fault kills a process, with no Python code run after this line.
    Costs one environment lookup when nothing is armed (no launcher, torchrun, or another rank).
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    armed = json.loads(spec)
    if int(os.environ.get("RANK", "-1")) != armed["rank"] or fault_label(name, index) != armed["point"]:
        return
    tmp = armed["file"] + ".tmp"
    with open(tmp, "w") as f:
        f.write(armed["point"])
    os.replace(tmp, armed["file"])          # the launcher sees the whole file or none
    deadline = time.monotonic() + FAULT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)                    # the launcher's SIGKILL lands here
    raise RuntimeError(f"rank {armed['rank']} reached its injected fault at {armed['point']} and waited "
                       f"{FAULT_WAIT_S:g} s, but the launcher never killed it (was it stopped?)")


def _check_fault(fault: Any, world_size: int) -> tuple[int, str] | None:
    if fault is None:
        return None
    if (not isinstance(fault, (tuple, list)) or len(fault) != 2 or isinstance(fault[0], bool)
            or not isinstance(fault[0], int) or not isinstance(fault[1], str)):
        raise TypeError(f"fault= takes (rank, point), e.g. (1, 'step 7') for the rank's fault_point('step', 7); "
                        f"got {fault!r}")
    if not 0 <= fault[0] < world_size:
        raise ValueError(f"fault=({fault[0]}, {fault[1]!r}) names rank {fault[0]}, but the launch has ranks "
                         f"0..{world_size - 1}")
    return int(fault[0]), fault[1]


def gpu_count() -> int:
    """GPUs torch can see from this process."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> NCCL when there is a GPU per rank, else gloo; explicit names are checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    gpus = gpu_count()
    if backend == "nccl":
        if not dist.is_nccl_available() or gpus == 0:
            raise ValueError("backend='nccl' needs CUDA GPUs and an NCCL build of torch; "
                             "this machine has none. Use backend='gloo' (CPU) or 'auto'.")
        if world_size > gpus:
            raise ValueError(f"backend='nccl' runs one rank per GPU: {world_size} ranks asked, "
                             f"{gpus} GPU(s) here. Use world_size<={gpus}, or backend='gloo'.")
        return "nccl"
    if backend == "gloo":
        return "gloo"
    if gpus >= world_size and dist.is_nccl_available():
        return "nccl"
    global _said_cpu_fallback
    if not _said_cpu_fallback:
        why = "no GPU" if gpus == 0 else f"{gpus} GPU(s) for {world_size} ranks"
        print(f"distlab: {why} here, so ranks run on the CPU with gloo (1 thread per rank).")
        _said_cpu_fallback = True
    return "gloo"


# What the forkserver imports once, so that no rank pays for it again. torch._dynamo above all:
# optimizers, batch_isend_irecv, FSDP and DTensor import it lazily on first use, ~2 s per rank
# per launch on a laptop CPU (measured: 2.6 s of a 3 s check). With it, the rest costs 0.1 s more.
_PRELOAD = ("torch", "torch.distributed", "cloudpickle", "distlab.engine.runtime", "torch._dynamo",
            "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
            "torch.nn.parallel", "distlab.meters", "distlab.course.models", "distlab.checks", "distlab.engine.collectives",
            # ZeroRedundancyOptimizer: its import scripts functional optimizers with TorchScript, ~1-3 s per
            # rank per launch (chapter 3 launches it a dozen times)
            "torch.distributed.optim")


def _context() -> Any:
    """forkserver with torch preloaded (fast relaunch, CUDA-safe), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = torch.multiprocessing.get_context("forkserver")
        # The server imports these once; each rank is then a cheap fork of it.
        # The server never touches CUDA, so NCCL children stay safe.
        ctx.set_forkserver_preload(list(_PRELOAD))
        return ctx
    return torch.multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _without_main_module() -> Any:
    """Start processes that do not re-import the parent's `__main__`.

    multiprocessing's spawn and forkserver children import the parent's main
    module (a script, pytest, or in Jupyter `ipykernel_launcher` with all of
    IPython): seconds per rank, per launch. Ranks never need it: the function
    and its arguments travel by value with cloudpickle.
    """
    from multiprocessing import spawn
    original = spawn.get_preparation_data

    def without_main(name: str) -> dict:
        data = original(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, plus: module objects of a ModuleType *subclass* travel by name, and code keeps its
    file name.

    torch installs some modules (e.g. `torch.distributed.config`) as instances of
    a ModuleType subclass. cloudpickle pickles plain modules by import name but
    tries to pickle those by value, and fails. A function that uses
    `torch.distributed` and merely reads an attribute called `config` (say
    `model.config`) drags that module in.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            # cloudpickle writes every code object's file name as "<dynamic-code>"; keep the real one
            # (a notebook cell's), so that a rank's traceback or stack names the cell and the parent
            # can say which (`cell_name`).
            make, fields = cloudpickle.cloudpickle._code_reduce(obj)
            return make, tuple(obj.co_filename if f == "<dynamic-code>" else f for f in fields)
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and obj.__name__ in sys.modules:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _pickle_payload(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"launch needs a function to run on each rank, got {type(fn).__name__}")
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args, kwargs))
        return buffer.getvalue()
    except Exception as exc:  # noqa: BLE001 - cloudpickle raises many kinds
        raise LaunchError(
            f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: {exc}. "
            "Everything a rank needs must be picklable: create locks, files, sockets and "
            "process groups inside the function, not outside it.") from None


def _kill_tree(ranks: list[Any]) -> None:
    """Stop ranks and anything they started: SIGTERM, a short grace, then SIGKILL."""
    procs.kill_tree([p.pid for p in ranks if p.pid is not None])
    for p in ranks:
        p.join(timeout=5)


def _replay_output(workdir: str, world_size: int) -> None:
    """Print each rank's captured stdout/stderr here, in rank order, prefixed."""
    for r in range(world_size):
        for suffix, stream in (("out", sys.stdout), ("errlog", sys.stderr)):
            path = os.path.join(workdir, f"rank{r}.{suffix}")
            if not os.path.exists(path):
                continue
            with open(path, errors="replace") as f:
                text = f.read()
            for line in text.splitlines():
                stream.write(f"[rank {r}] {line}\n")
    sys.stdout.flush()
    sys.stderr.flush()


def _read_error(workdir: str, r: int, loads: Callable[[bytes], Any] = cloudpickle.loads) -> dict | None:
    path = os.path.join(workdir, f"rank{r}.err")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        err = loads(data)
    except Exception as exc:  # noqa: BLE001 - a rank may have written anything there
        return {"type": "MalformedError", "message": f"the rank's error report could not be read ({exc})",
                "traceback": ""}
    if not (isinstance(err, dict) and all(isinstance(err.get(k), str) for k in ("type", "message", "traceback"))):
        return {"type": "MalformedError", "message": "the rank's error report is malformed", "traceback": ""}
    return err


def _stacks(ranks: list[Any], stuck: list[int], workdir: str) -> dict[int, str]:
    """Where each stuck rank waits: ask it for its Python stack (SIGUSR1 -> faulthandler)."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    for r in stuck:
        try:
            os.kill(ranks[r].pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    out: dict[int, str] = {}
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and len(out) < len(stuck):
        time.sleep(0.05)
        for r in stuck:
            path = os.path.join(workdir, f"rank{r}.stack")
            if r not in out and os.path.exists(path) and os.path.getsize(path):
                time.sleep(0.05)  # let the dump finish
                with open(path, errors="replace") as f:
                    out[r] = f.read()
    return out


def _notes(stuck: list[int], workdir: str) -> dict[int, str]:
    """The last `distlab.engine.runtime.progress` line of each stuck rank."""
    out = {}
    for r in stuck:
        try:
            with open(os.path.join(workdir, f"rank{r}.note"), errors="replace") as f:
                out[r] = f.read().strip()
        except OSError:
            pass
    return out


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe")


# A rank's own report of a stall on the strict backend (distlab.engine.strict).
_STALL_TYPES = ("StrictStall", "CollectiveTimeout")


def _failure(ranks: list[Any], workdir: str, r: int, loads: Callable[[bytes], Any]) -> dict[str, Any]:
    err = _read_error(workdir, r, loads)
    if err is None:
        ranks[r].join(timeout=1)
        # NCCL's watchdog aborts a rank without a Python error: its flight recorder's dump, the hang watch's
        # last status with SIGABRT, or (last) the text NCCL printed say which op (distlab.engine.watchdog).
        watchdog = _watchdog.abort_reason(workdir, r, ranks[r].exitcode)
        if watchdog:
            err = {"type": "CollectiveTimeout", "traceback": "", "message": watchdog}
        else:
            err = {"type": "ProcessDied", "traceback": "",
                   "message": f"the process exited with code {ranks[r].exitcode} without a Python "
                              "error (killed, out of memory, or os._exit)"}
    return err


def _as_stack(err: dict[str, Any]) -> str:
    """Where a stalled rank's op was issued, in faulthandler's shape (innermost frame first): the line the
    strict backend names ("issued at fn (file:line)"), else the rank's traceback."""
    import re
    issued = re.search(r"issued at (\S+) \((.+):(\d+)\)", err.get("message", ""))
    if issued:
        fn, path, line = issued.groups()
        return f'File "{path}", line {line} in {fn}'
    frames = [line.strip().replace(", in ", " in ") for line in err.get("traceback", "").splitlines()
              if line.strip().startswith("File ")]
    return "\n".join(reversed(frames))


def _root_cause(failed: dict[int, dict[str, Any]]) -> int:
    """The rank to blame: one that died outright, else one whose error is not a lost peer, else the lowest."""
    def rank_of(r: int) -> tuple[int, int]:
        err = failed[r]
        if err["type"] == "ProcessDied":
            return (0, r)
        return (2 if any(p in str(err.get("message", "")) for p in _PEER_GONE) else 1, r)
    return min(failed, key=rank_of)


def _wait(ranks: list[Any], pipes: list[Any], workdir: str, timeout_s: float, stall_s: float,
          loads: Callable[[bytes], Any] = cloudpickle.loads, work_cap: float | None = None,
          fault: tuple[int, str] | None = None) -> list[Any]:
    """Wait until every rank reports; on the first failure, a stall, a rank past `work_cap` CPU seconds
    or the deadline, raise. When the rank armed by `fault` reaches its point, kill it and raise
    `FaultInjected`.

    A rank reports on its pipe ("ok" or "err"); a rank that dies without a
    report is seen through its process sentinel.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    pending = set(range(len(ranks)))
    waitables = {pipes[r]: r for r in pending} | {ranks[r].sentinel: r for r in pending}
    monitor = procs.ProgressMonitor()
    last_work = start
    while pending:
        if fault is not None and os.path.exists(os.path.join(workdir, f"rank{fault[0]}.fault")):
            victim = ranks[fault[0]]
            os.kill(victim.pid, signal.SIGKILL)           # from outside: the rank runs no more Python
            victim.join(timeout=5)
            raise FaultInjected(fault[0], fault[1], sorted(pending - {fault[0]}))
        now = time.monotonic()
        if now >= deadline:
            raise LaunchTimeout(sorted(pending), timeout_s)
        if monitor.busy([ranks[r].pid for r in pending], now):
            last_work = now
            if work_cap is not None:
                cpu = {r: monitor.cpu_s.get(ranks[r].pid, 0.0) for r in sorted(pending)}
                if max(cpu.values()) > work_cap:
                    stuck = sorted(pending)
                    raise LaunchOverran(stuck, work_cap, _stacks(ranks, stuck, workdir),
                                        sorted(set(range(len(ranks))) - pending), _notes(stuck, workdir), cpu)
        elif now - last_work >= stall_s:
            stuck = sorted(pending)
            raise LaunchStalled(stuck, stall_s, _stacks(ranks, stuck, workdir),
                                sorted(set(range(len(ranks))) - pending), _notes(stuck, workdir))
        # A short poll keeps KeyboardInterrupt responsive in Jupyter.
        for obj in multiprocessing.connection.wait(list(waitables), timeout=min(deadline - now, 0.2)):
            r = waitables.pop(obj)
            if r not in pending:
                continue
            if obj is pipes[r]:
                try:
                    status = obj.recv()
                except EOFError:
                    continue  # died without reporting: its sentinel will tell
                if status == "ok":
                    pending.discard(r)
                    continue
            pending.discard(r)
            failed = {r: _failure(ranks, workdir, r, loads)}
            # A rank that dies makes its peers fail too ("Connection closed by peer"), and a peer's
            # report can arrive first: wait a moment for the others and name the root cause.
            settle = time.monotonic() + 1.0
            while pending and time.monotonic() < settle:
                for obj in multiprocessing.connection.wait(list(waitables), timeout=0.1):
                    q = waitables.pop(obj)
                    if q not in pending:
                        continue
                    if obj is pipes[q]:
                        try:
                            if obj.recv() == "ok":
                                pending.discard(q)
                                continue
                        except EOFError:
                            continue
                    pending.discard(q)
                    failed[q] = _failure(ranks, workdir, q, loads)
            r = _root_cause(failed)
            err = failed[r]
            if err["type"] in _STALL_TYPES:
                # A collective no peer joined, reported by the rank itself (the strict backend) or by NCCL's
                # watchdog: a stall, found by the group's timeout where CPU time could not tell.
                stalled = sorted(q for q in failed if failed[q]["type"] in _STALL_TYPES)
                done = sorted(set(range(len(ranks))) - pending - set(failed))
                raise LaunchStalled(stalled, stall_s, {q: _as_stack(failed[q]) for q in stalled},
                                    done, _notes(stalled, workdir),
                                    detail={q: failed[q]["message"] for q in stalled})
            others = f"unfinished at that moment: {sorted(pending)}" if pending else ""
            if len(failed) > 1:
                others = "; ".join(filter(None, [others, f"also failed: {sorted(set(failed) - {r})}"]))
            raise RankFailed(r, err["type"], err["message"], err["traceback"], others)
    if fault is not None:
        raise LaunchError(f"the fault armed at rank {fault[0]}, {fault[1]!r}, was never reached: every rank "
                          f"returned. Does rank {fault[0]}'s code call fault_point with that name and index?")
    results = []
    for r in range(len(ranks)):
        with open(os.path.join(workdir, f"rank{r}.ok"), "rb") as f:
            results.append(loads(f.read()))
    return results


def _settings() -> dict[str, str]:
    """distlab's settings ($DISTLAB_*) as they are now: each rank applies them. Ranks fork from a fork
    server that keeps the environment it started with, and a setting changed since (a test's, a notebook's
    `%env`) must reach the ranks of this launch, not only those of the first."""
    return {k: v for k, v in os.environ.items() if k.startswith("DISTLAB_")}


def audit_requested() -> bool:
    """True when $DISTLAB_DEVICE_AUDIT asks every launch to audit device placement."""
    return os.environ.get("DISTLAB_DEVICE_AUDIT", "0") not in ("", "0", "false", "False")


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple | list = (), kwargs: dict | None = None,
           backend: str | None = None, stall: float | None = None, strict: bool | None = None) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results by rank.

        distlab.launch(train, 4, args=(model, 10), kwargs={"lr": 0.1})

    Your function's arguments travel in `args` (a tuple) and `kwargs` (a dict),
    so they never collide with the launcher's own options, which are:
    `backend` (default $DISTLAB_BACKEND, else "auto": NCCL when there is a GPU
    per rank, else gloo);
    `stall` (seconds, default `default_stall(backend)`): how long every
    unfinished rank may go without any work before the launch counts as stuck;
    `strict` (default: $DISTLAB_STRICT): CPU ranks run on the strict backend,
    gloo with NCCL's semantics (see `distlab.engine.strict`).
    The process group is up before `fn` starts and torn down after it ends.
    Raises `RankFailed` if any rank raises, `LaunchStalled` if the ranks wait
    for each other forever; in every case all ranks are stopped before it
    returns. (The grader's and the test suite's options live on `run_on_ranks`.)
    """
    return run_on_ranks(fn, world_size, args=args, kwargs=kwargs, backend=backend, stall=stall, strict=strict)


def _check_arguments(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args= takes a tuple of your function's positional arguments, got "
                        f"{type(args).__name__}: write args=({args!r},) for a single argument")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs= takes a dict of your function's keyword arguments, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})


def run_on_ranks(fn: Callable[..., Any], world_size: int, *, args: tuple | list = (), kwargs: dict | None = None,
                 backend: str | None = None, stall: float | None = None, strict: bool | None = None,
                 timeout: float | None = None, audit: bool | None = None,
                 loads: Callable[[bytes], Any] | None = None, work_cap: float | None = None,
                 fault: tuple[int, str] | None = None) -> list[Any]:
    """`launch` with the options the grader, the tour, the lectures and the test suite also need.

    `timeout` (seconds, default 4 h): a last-resort cap on the whole launch
    (raises `LaunchTimeout`). `audit` (default: $DISTLAB_DEVICE_AUDIT): on CPU
    ranks, enforce the rule a GPU enforces (see `distlab.engine.audit`);
    `strict` implies it. On NCCL a rank spinning behind a hung kernel
    looks busy to the CPU-time monitor: there each rank's hang watch
    (`distlab.engine.watchdog`, PyTorch's flight recorder compared through the
    store) reports the op that never completed after the stall window, and the
    group's own timeout is the stall window with a floor
    (`runtime.group_timeout_s`), since NCCL counts from enqueue. `loads` (default `cloudpickle.loads`) reads each rank's
    result and error report; `distlab grade` passes a safe unpickler, since
    learner code runs on the ranks and can write anything into those files.
    `distlab grade --backend gloo` sets $DISTLAB_BACKEND, so that a check's
    reference runs where the learner's ranks run.
    `work_cap` (CPU seconds, default None: no cap): a livelock bound. When any
    one rank (with its child processes) has used more CPU time than this, the
    launch stops and raises `LaunchOverran`, with each unfinished rank's stack
    sample, as `LaunchStalled` does. CPU time, not wall time: a loaded machine
    slows a healthy rank's clock, not its work. (A graded check passes a cap
    derived from its reference's time, `distlab.checks.task.work_cap_for`.)
    `fault` ((rank, point), default None): inject a fault. Rank `rank` is killed with SIGKILL by this
    process when its code reaches `fault_point(name, index)` with `fault_label(name, index) == point`
    ("step 7"); every other rank is stopped and the launch raises `FaultInjected`. A launch that ends
    without reaching the point raises `LaunchError`.
    """
    args, kwargs = _check_arguments(args, kwargs)
    world_size = _check_world_size(world_size)
    backend = resolve_backend(backend or os.environ.get("DISTLAB_BACKEND") or "auto", world_size)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    stall = default_stall(backend) if stall is None else float(stall)
    if timeout <= 0 or stall <= 0 or (work_cap is not None and work_cap <= 0):
        raise ValueError(f"timeout, stall and work_cap must be positive seconds, got timeout={timeout}, "
                         f"stall={stall}, work_cap={work_cap}")
    audit = audit_requested() if audit is None else bool(audit)
    strict = (_strict.requested() if strict is None else bool(strict)) and backend == "gloo"
    audit = audit or strict
    fault = _check_fault(fault, world_size)
    payload = _pickle_payload(fn, args, kwargs)
    # Quiet c10d's C++ INFO/WARNING lines in the ranks (they vary run to run).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="distlab-launch-")
    # This process hosts the rendezvous store: port 0 lets the OS pick a free
    # port, so concurrent launches never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ranks: list[Any] = []
    pipes: list[Any] = []
    settings = {k: v for k, v in _settings().items() if k != FAULT_ENV}   # a fault is armed per launch
    if fault is not None:
        settings[FAULT_ENV] = json.dumps({"rank": fault[0], "point": fault[1],
                                          "file": os.path.join(workdir, f"rank{fault[0]}.fault")})
    try:
        for r in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_runtime.worker_main, name=f"distlab-rank{r}",
                            args=(r, world_size, backend, store.port, payload, workdir,
                                  timeout, send_end, audit, stall, strict, settings))
            with _without_main_module():
                p.start()
            send_end.close()  # the child holds the only write end: EOF means it died
            ranks.append(p)
            pipes.append(recv_end)
        results = _wait(ranks, pipes, workdir, timeout, stall, loads or cloudpickle.loads, work_cap, fault)
        store.set(_runtime.EXIT_KEY, "1")  # every rank succeeded: let them leave together
        for p in ranks:
            p.join(timeout=10)
        return results
    finally:
        # Runs on success, failure, stall, timeout and KeyboardInterrupt alike.
        _kill_tree([p for p in ranks if p.is_alive()])
        for p in ranks:
            p.join(timeout=5)
        for c in pipes:
            c.close()
        del store
        _replay_output(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)
