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
Failures come back as `RankFailed` / `LaunchTimeout`, and no process is left
behind in any case, Jupyter's interrupt included.
"""
from __future__ import annotations

import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any, Callable

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from distlab import rank as _rank

BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_TIMEOUT_S = 120.0
_KILL_GRACE_S = 1.0
_said_cpu_fallback = False


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


class LaunchTimeout(LaunchError):
    """Some ranks did not finish in time. `ranks` lists them."""

    def __init__(self, ranks: list[int], timeout_s: float):
        self.ranks = ranks
        super().__init__(
            f"rank(s) {ranks} did not finish within {timeout_s:g} s and were stopped. "
            "A collective that only some ranks call waits forever: check that every rank "
            "reaches the same collectives in the same order, or pass a larger timeout=.")


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


def _context() -> Any:
    """forkserver with torch preloaded (fast relaunch, CUDA-safe), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = torch.multiprocessing.get_context("forkserver")
        # The server imports these once; each rank is then a cheap fork of it.
        # The server never touches CUDA, so NCCL children stay safe.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "distlab.rank"])
        return ctx
    return torch.multiprocessing.get_context("spawn")


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return world_size


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, plus: module objects of a ModuleType *subclass* travel by name.

    torch installs some modules (e.g. `torch.distributed.config`) as instances of
    a ModuleType subclass. cloudpickle pickles plain modules by import name but
    tries to pickle those by value, and fails. A function that uses
    `torch.distributed` and merely reads an attribute called `config` (say
    `model.config`) drags that module in.
    """

    def reducer_override(self, obj: Any) -> Any:
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


def _kill_tree(procs: list[Any]) -> None:
    """Stop ranks and anything they started: SIGTERM, a short grace, then SIGKILL."""
    victims: list[psutil.Process] = []
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            victims += root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=_KILL_GRACE_S)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for p in procs:
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


def _read_error(workdir: str, r: int) -> dict | None:
    path = os.path.join(workdir, f"rank{r}.err")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return cloudpickle.loads(f.read())


def _wait(procs: list[Any], pipes: list[Any], workdir: str, timeout_s: float) -> list[Any]:
    """Wait until every rank reports; on the first failure or the deadline, raise.

    A rank reports on its pipe ("ok" or "err"); a rank that dies without a
    report is seen through its process sentinel.
    """
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(procs)))
    waitables = {pipes[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchTimeout(sorted(pending), timeout_s)
        # A short poll keeps KeyboardInterrupt responsive in Jupyter.
        for obj in multiprocessing.connection.wait(list(waitables), timeout=min(left, 0.2)):
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
            err = _read_error(workdir, r)
            if err is None:
                procs[r].join(timeout=1)
                err = {"type": "ProcessDied", "traceback": "",
                       "message": f"the process exited with code {procs[r].exitcode} without a Python "
                                  "error (killed, out of memory, or os._exit)"}
            others = f"unfinished at that moment: {sorted(pending)}" if pending else ""
            raise RankFailed(r, err["type"], err["message"], err["traceback"], others)
    results = []
    for r in range(len(procs)):
        with open(os.path.join(workdir, f"rank{r}.ok"), "rb") as f:
            results.append(cloudpickle.loads(f.read()))
    return results


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results by rank.

    The process group is up before `fn` starts and torn down after it ends.
    `timeout` (seconds) bounds the whole launch and each collective.
    Raises `RankFailed` if any rank raises, `LaunchTimeout` if some ranks do not
    finish in time; in every case all ranks are stopped before it returns.
    """
    world_size = _check_world_size(world_size)
    backend = resolve_backend(backend, world_size)
    payload = _pickle_payload(fn, args, kwargs)
    # Quiet c10d's C++ INFO/WARNING lines in the ranks (they vary run to run).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="distlab-launch-")
    # This process hosts the rendezvous store: port 0 lets the OS pick a free
    # port, so concurrent launches never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    procs: list[Any] = []
    pipes: list[Any] = []
    try:
        for r in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank.worker_main, name=f"distlab-rank{r}",
                            args=(r, world_size, backend, store.port, payload, workdir,
                                  float(timeout), send_end))
            p.start()
            send_end.close()  # the child holds the only write end: EOF means it died
            procs.append(p)
            pipes.append(recv_end)
        results = _wait(procs, pipes, workdir, timeout)
        store.set(_rank.EXIT_KEY, "1")  # every rank succeeded: let them leave together
        for p in procs:
            p.join(timeout=10)
        return results
    finally:
        # Runs on success, failure, timeout and KeyboardInterrupt alike.
        _kill_tree([p for p in procs if p.is_alive()])
        for p in procs:
            p.join(timeout=5)
        for c in pipes:
            c.close()
        del store
        _replay_output(workdir, world_size)
        shutil.rmtree(workdir, ignore_errors=True)
