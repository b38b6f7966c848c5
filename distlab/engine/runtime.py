"""Inside a rank: who am I, where do I compute, and the worker that `launch` starts.

Everything here runs in a child process started by `distlab.launch` (or under
`torchrun`). The helpers read the live process group, so the same learner code
works in both places:

    def step():
        print0(f"{world_size()} ranks on {device()}")
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Messages that would make a notebook's output differ from run to run, or that
# speak to PyTorch developers rather than to a learner.
_QUIET_WARNINGS = (
    r".*all_gather_into_tensor.*deprecated.*",
    r".*reduce_scatter_tensor.*deprecated.*",
    r".*_get_default_group.*",
    r".*TypedStorage is deprecated.*",
    r".*barrier\(\): using the device under current context.*",
    r".*No device id is provided via `init_process_group` or `barrier `.*",
)


def quiet_library_warnings() -> None:
    """Silence the library warnings listed above (learner warnings still show)."""
    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def rank() -> int:
    """This process's rank in the default group (0 outside a group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the default group (1 outside a group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    """Rank within this machine: selects the GPU under NCCL."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def backend() -> str:
    """'nccl', 'gloo', or 'none' outside a group. The strict backend (gloo with NCCL's rules, see
    `distlab.engine.strict`) reports 'gloo': its ranks are CPU ranks."""
    if not dist.is_initialized():
        return "none"
    name = dist.get_backend()
    return "gloo" if name == "strict" else name


def device() -> torch.device:
    """The device this rank computes on: cuda:local_rank under NCCL, else cpu."""
    if backend() in ("nccl", "metered_nccl"):   # metered_nccl: NCCL under `distlab grade`'s metered group
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def mesh(*shape: int, names: tuple[str, ...] | None = None) -> Any:
    """A DeviceMesh over this job's ranks, built on the rank's device type.

    `mesh()` is the 1-D mesh of every rank, for `fully_shard(model, mesh=mesh())`;
    `mesh(2, 2, names=("dp", "tp"))` a 2-D one. Always pass a mesh to
    `fully_shard`: without one it builds a mesh on the machine's accelerator
    type, which is CUDA on a GPU box even when the ranks run gloo on the CPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    shape = shape or (world_size(),)
    return init_device_mesh(device().type, tuple(shape), mesh_dim_names=names)


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only: one line per job instead of one per rank."""
    if rank() == 0:
        print(*args, **kwargs)


def init_process_group(backend_name: str, *, timeout_s: float, store: Any = None,
                       rank_: int | None = None, world_size_: int | None = None) -> None:
    """Join the default group; under NCCL bind this rank to its own GPU first.

    Without `store`, the rendezvous comes from the environment (torchrun's
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    """
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank_, world_size=world_size_)
    if backend_name == "nccl":
        # One GPU per rank: NCCL refuses two ranks on one device.
        torch.cuda.set_device(local_rank())
        kwargs["device_id"] = torch.device("cuda", local_rank())
    else:
        # N ranks share the CPU cores: one intra-op thread each avoids
        # N x cores threads fighting for the same cores.
        torch.set_num_threads(1)
    dist.init_process_group(backend_name, **kwargs)


def agree_on_backend(store: Any, rank_: int, world: int, mine: str) -> str:
    """Every rank's backend choice, through `store`: the common one, or an error naming the ranks that
    differ (which hosts lack a GPU per local rank) and what to do."""
    import socket
    store.set(f"distlab/backend/{rank_}", f"{mine} {socket.gethostname()}")
    choices = [store.get(f"distlab/backend/{r}").decode().split(" ", 1) for r in range(world)]
    kinds = {kind for kind, _ in choices}
    if len(kinds) == 1:
        return mine
    by_kind = {k: sorted({host for r, (kind, host) in enumerate(choices)
                          if kind == k}) for k in kinds}
    raise RuntimeError(
        f"rank {rank_}: the nodes disagree on the backend: " +
        "; ".join(f"{k} on {', '.join(hosts)}" for k, hosts in sorted(by_kind.items())) +
        ". NCCL needs a GPU for every local rank on every node; give each node as many GPUs as "
        "--nproc-per-node, or run every node on gloo (DISTLAB_BACKEND=gloo).")


def run_under_torchrun(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` as one rank of a `torchrun` job (env:// rendezvous).

    Picks NCCL when this node has a GPU for every local rank, gloo otherwise,
    and always tears the group down. A job script ends its rank with `end_rank` afterwards.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    use_nccl = (torch.cuda.is_available() and dist.is_nccl_available()
                and torch.cuda.device_count() >= local_world)
    # A collective waits this long for its peers (a last resort: slow is not hung).
    timeout_s = float(os.environ.get("DISTLAB_TIMEOUT", 4 * 3600))
    rank_, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # The env:// rendezvous, made here so that the nodes can agree on a backend before any group exists:
    # a node without GPUs would otherwise join with gloo while the others join with NCCL, and hang.
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          world, is_master=rank_ == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                          timeout=timedelta(seconds=timeout_s))
    mine = os.environ.get("DISTLAB_BACKEND") or ("nccl" if use_nccl else "gloo")
    init_process_group(agree_on_backend(store, rank_, world, mine), timeout_s=timeout_s, store=store,
                       rank_=rank_, world_size_=world)
    try:
        return fn(*args, **kwargs)
    finally:
        dist.destroy_process_group()


def end_rank(code: int = 0) -> None:
    """End a torchrun rank after `run_under_torchrun`: flush, then `os._exit(code)`, as `distlab.launch`'s
    ranks end. Python's own shutdown would finalize the interpreter while the process group may still run:
    learner code that keeps its module alive through a gradient hook (a cycle through C++ that the garbage
    collector cannot see) keeps the group too, and gloo's three threads outlive `destroy_process_group`
    (measured after the DDP lab's measurement). A gloo thread that drops its last op's tensors late then
    needs the GIL of a finalized interpreter, and the rank aborts (SIGABRT, "terminate called without an
    active exception") after its work is done: torchrun fails the job, and the other nodes wait out their
    exit barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _to_cpu(value: Any) -> Any:
    """Move tensors in a return value to the CPU so the caller never touches CUDA."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def _redirect_output(stdout_path: str, stderr_path: str) -> None:
    """Send fd 1 and 2 (Python and C++ output alike) to per-rank files."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


EXIT_KEY = "distlab/exit"
_NOTE_PATH: str | None = None   # where `progress` writes, inside a rank started by distlab.launch


def progress(text: str) -> None:
    """Say what this rank is doing now (one short line). If the ranks hang, the launcher
    reports the last thing each said: "case: 1001 elements, bfloat16, max"."""
    if _NOTE_PATH is None:
        return
    with open(_NOTE_PATH, "w") as f:
        f.write(text[:300])


def _stack_on_request(path: str) -> None:
    """On SIGUSR1, write this process's Python stacks to `path` (the launcher asks when a rank is stuck)."""
    import faulthandler
    import signal
    if hasattr(signal, "SIGUSR1"):
        f = open(path, "w")  # noqa: SIM115 - stays open for the life of the rank
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=False, chain=False)


def group_timeout_s(backend_name: str, timeout_s: float, stall_s: float | None) -> float:
    """The process group's timeout. On NCCL: the stall window with a floor (`watchdog.nccl_timeout_s`,
    at least 30 s). NCCL counts from the moment an op is enqueued, so a timeout as short as the stall
    window would abort a rank whose peer is only late; a hang is reported within the stall window by the
    rank's `HangWatch` instead (a rank blocked behind a hung kernel spins at 100% CPU, so CPU time cannot
    tell). Elsewhere the launch's cap: gloo blocks with the CPU idle, and the launcher sees that."""
    if backend_name == "nccl" and stall_s:
        from distlab.engine.watchdog import nccl_timeout_s
        return nccl_timeout_s(stall_s)
    return float(timeout_s)


# One outcome per rank: the main thread's, or the hang watch's (from its thread), whichever comes first.
_DELIVERY = threading.Lock()


def _deliver(workdir: str, rank_: int, notify: Any, name: str, data: bytes) -> None:
    """Write `rank{r}.ok` or `rank{r}.err` and say which on the pipe. Holds `_DELIVERY` for good: a
    second outcome from another thread waits forever (the process ends first)."""
    _DELIVERY.acquire()
    with open(os.path.join(workdir, f"rank{rank_}.{name}"), "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    notify.send(name)


def _start_watch(rank_: int, world_size_: int, port: int, workdir: str, notify: Any,
                 stall_s: float, nccl_s: float) -> Any:
    """The NCCL rank's hang watch (`distlab.engine.watchdog`), on a store connection of its own. Its
    report ends the rank as a `CollectiveTimeout`, which the launcher reports as a stall."""
    import cloudpickle

    from distlab.engine.watchdog import HangWatch

    def report(message: str) -> None:
        err = {"type": "CollectiveTimeout", "message": message, "traceback": ""}
        _deliver(workdir, rank_, notify, "err", cloudpickle.dumps(err))
        os._exit(1)

    store = dist.TCPStore("127.0.0.1", port, world_size_, is_master=False, timeout=timedelta(seconds=30))
    return HangWatch(rank_, world_size_, store, stall_s, nccl_s, report,
                     note_path=os.path.join(workdir, f"rank{rank_}.watch")).start()


def worker_main(rank_: int, world_size_: int, backend_name: str, port: int,
                payload: bytes, workdir: str, timeout_s: float, notify: Any, audit: bool = False,
                stall_s: float | None = None, strict: bool = False, settings: dict[str, str] | None = None) -> None:
    """Entry point of one rank started by `distlab.launch`.

    Writes `rank{r}.ok` (the pickled return value) or `rank{r}.err` (type,
    message, traceback) into `workdir` and says which on the `notify` pipe.
    A rank that succeeded keeps its process group until the parent sets
    EXIT_KEY in the store: a rank that finished early must not tear down a
    collective that another rank is still (wrongly) waiting in, or a hang
    would turn into a misleading 'connection reset' on the other rank.
    """
    import cloudpickle

    _redirect_output(os.path.join(workdir, f"rank{rank_}.out"), os.path.join(workdir, f"rank{rank_}.errlog"))
    _stack_on_request(os.path.join(workdir, f"rank{rank_}.stack"))
    global _NOTE_PATH
    _NOTE_PATH = os.path.join(workdir, f"rank{rank_}.note")
    quiet_library_warnings()
    if settings is not None:      # the launcher's $DISTLAB_* now, not the fork server's from its start
        for key in [k for k in os.environ if k.startswith("DISTLAB_") and k not in settings]:
            del os.environ[key]
        os.environ.update(settings)
    os.environ.update(RANK=str(rank_), WORLD_SIZE=str(world_size_), LOCAL_RANK=str(rank_),
                      LOCAL_WORLD_SIZE=str(world_size_), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    outcome: dict[str, Any]
    store = None
    watch = None
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size_, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        if strict:
            from distlab.engine import strict as strict_mod
            strict_mod.register()
            strict_mod.STALL_S = stall_s
            backend_name = strict_mod.STRICT_BACKEND
        if backend_name == "nccl":
            from distlab.engine import watchdog
            watchdog.prepare(workdir)       # the flight recorder on, its dump on a timeout in workdir
        init_process_group(backend_name, timeout_s=timeout_s, store=store,
                           rank_=rank_, world_size_=world_size_)
        if backend_name == "nccl":
            # Connected with the long timeout (NCCL's first init may take seconds); its ops then time out
            # at the stall window's floor, and the hang watch reports a real hang within the window.
            nccl_s = group_timeout_s(backend_name, timeout_s, stall_s)
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=nccl_s))
            if stall_s:
                watch = _start_watch(rank_, world_size_, port, workdir, notify, stall_s, nccl_s)
        fn, args, kwargs = cloudpickle.loads(payload)
        with contextlib.ExitStack() as rules:
            if audit and backend_name != "nccl":
                from distlab.engine.audit import DeviceAudit
                audit_ = rules.enter_context(DeviceAudit(strict=strict))
                # On a GPU box, tensors passed to launch() arrive on each rank as CPU tensors.
                audit_.mark_host((args, kwargs), "an argument of launch()")
            if strict:
                rules.enter_context(strict_mod.strict_rank())
            result = fn(*args, **kwargs)
        if backend_name == "nccl":
            # The rank's queued kernels finish before it reports success: a collective that no peer joined
            # surfaces here (the hang watch reports it), not as a rank that "returned".
            torch.cuda.synchronize()
            if watch is not None:
                watch.finish()
        result = _to_cpu(result)
        try:
            blob = cloudpickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the learner's to fix
            raise TypeError(
                f"rank {rank_} returned a {type(result).__name__} that cannot be pickled "
                f"({exc}); return plain numbers, lists, dicts or CPU tensors") from None
        outcome = {"ok": blob}
    except BaseException as exc:  # noqa: BLE001 - report everything, KeyboardInterrupt included
        outcome = {"err": {"type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc()}}
    name = "ok" if "ok" in outcome else "err"
    data = outcome["ok"] if name == "ok" else cloudpickle.dumps(outcome["err"])
    _deliver(workdir, rank_, notify, name, data)
    if watch is not None:
        watch.stop()
    if name == "ok" and store is not None:
        try:
            store.wait([EXIT_KEY], timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - parent gone or timed out: just leave
            pass
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may be broken after a failure
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if name == "ok" else 1)
