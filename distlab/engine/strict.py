"""The strict backend: NCCL's semantics on CPU ranks, where a program can tell the difference.

gloo and NCCL move the same bytes but keep different promises, and code written against gloo's can
be silently wrong on GPUs. Under the strict backend (`DISTLAB_STRICT=1`, or `launch(..., strict=True)`)
each CPU rank's process group is `StrictBackend`: gloo underneath (the bytes really cross between
the processes), NCCL's rules on top.

- **A collective returns before its data has moved.** NCCL enqueues the kernel and returns, even
  with `async_op=False`, and its `work.wait()` only orders the rank's stream after it: the host
  blocks later, at the first read of the result (`.item()`, `.cpu()`, a print). Here each
  collective and p2p op runs on private buffers; its outputs are *poisoned* (NaN, or the dtype's
  minimum for integers) until it completes. Completion happens where a GPU's stream would order it:
  the first torch op that touches an output of a joined (waited-for) op waits for it, then copies
  the result in (`StreamOrder`). An op that reads the output of an `async_op=True` collective before
  `wait()` reads the poison, as it would read stale or half-written bytes on a GPU.
- **A rank that waits spins**, as a CPU thread behind a hung CUDA kernel does (CUDA's default spin
  scheduling): CPU time says nothing about progress. A wait on an op that no peer joins raises
  `StrictStall` after the stall window, naming the rank, the op and the line that issued it — the
  report NCCL's watchdog gives when the group's timeout is the stall window (see `distlab.launch`).
- **`batch_isend_irecv` returns one Work for the whole group** (`one_work_per_p2p_group`).
- **Host tensors are refused in collectives, whatever their size** (the device audit, which the
  strict backend turns on, applies NCCL's rule to 0-dim and 1-element tensors too, and to tensors
  that arrived as `launch` arguments).

What it cannot emulate: stream *timing* (a kernel's duration is still the host's), NCCL's internal
buffers and memory, and collectives issued by C++ on buffers Python never sees until their future
completes (DDP's buckets complete in gloo's thread, as on a GPU they complete on NCCL's stream).
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

STRICT_BACKEND = "strict"
STALL_S: float | None = None     # the launch's stall window, set by the rank before its group is built


class StrictStall(RuntimeError):
    """A strict op waited the whole stall window: a peer never joined it (NCCL's watchdog timeout)."""


class GroupWork:
    """The one Work NCCL returns for a coalesced group: done only when every op of the group is."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


@contextlib.contextmanager
def one_work_per_p2p_group() -> Iterator[None]:
    """`dist.batch_isend_irecv` returns [GroupWork(all of the group's Works)] while this is active.

    On NCCL, `dist.batch_isend_irecv(ops)` returns a list holding ONE Work for the whole group, while
    gloo returns one Work per op: code that pairs the returned Works with its ops
    (`zip(recv_parts, works)`) is right on gloo and silently wrong on NCCL.
    """
    original = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        _GROUPING.append([])
        try:
            works = original(p2p_op_list)
        finally:
            group = _GROUPING.pop()
        if group:     # strict ops: the stream runs the group as one unit
            group[0].stream.put(_Group(group))
        return [GroupWork(list(works))] if works else works

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


# ----------------------------------------------------------------------------------------------
# Deferred completion


def _poison(t: torch.Tensor) -> None:
    """Fill `t` with a value no result has, through `.data`: the bytes change as a kernel's write would,
    the version counter autograd checks does not (NCCL's write into an output bumps none either)."""
    if t.numel() == 0:
        return
    t = t.data
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _issuer() -> str:
    """'fn (file:line)' of the innermost frame outside torch and distlab's engine: the line that issued the op."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torch/" not in f and "/distlab/engine/" not in f:
            return f"{frame.name} ({f}:{frame.lineno})"
    return "an unknown line"


def _collective_result(t: Any) -> torch.Tensor | None:
    """The tensor a functional collective's result wraps (`AsyncCollectiveTensor.elem`, what DTensor's
    redistributions and parallelize_module's layers return), else None. Any use of such a result first
    calls `wait_tensor` on it: on NCCL that orders the use after the collective on the stream."""
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` covers in memory: exact for a contiguous tensor, its whole storage otherwise.
    A tensor subclass without storage (DTensor) is its local tensor; a functional collective's result,
    the tensor it wraps."""
    inner = getattr(t, "_local_tensor", None)
    if inner is None:
        inner = _collective_result(t)
    if inner is not None:
        return _span(inner)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not torch._C._has_storage(t):
        return (0, 0)
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    try:
        storage = t.untyped_storage()
    except RuntimeError:    # a wrapper subclass with no real storage of its own
        return (0, 0)
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class _Pending:
    """Every op of this rank issued and not yet completed, with the bytes its outputs cover."""

    def __init__(self) -> None:
        self.works: list[StrictWork] = []

    def complete_joined(self, tensors: list[torch.Tensor], *, join: bool = False) -> None:
        """Complete each joined op whose outputs overlap `tensors`: a GPU stream runs it before them.
        (An unjoined op is not waited for: on a GPU nothing orders a read after it.) `join=True` joins the
        overlapping ops first: `tensors` are functional collectives' results about to be used, and their use
        waits for them (`wait_tensor`), so a GPU stream orders it after them too."""
        if not self.works:
            return
        spans = [_span(t) for t in tensors if isinstance(t, torch.Tensor) and t.numel() and t.device.type == "cpu"]
        with _LOCK:
            works = list(self.works)
        for w in works:
            if (join or w.joined) and not w.done and any(a < d and c < b for a, b in spans for c, d in w.spans):
                if join:
                    w.wait()
                w.complete()

    def complete_all(self) -> None:
        with _LOCK:
            works = list(self.works)
        for w in works:
            w.complete()


_PENDING = _Pending()
_LOCK = threading.Lock()
_SEQ = itertools.count(1)          # ops, numbered in issue order on this rank
_STREAMS = itertools.count(0)


class _Stream:
    """A process group's NCCL stream, as far as completion goes: its ops finish in issue order, in a thread
    of their own (the host goes on). A joined op's result is copied in when it arrives; an unjoined one's
    waits for its `wait()` (until then nothing orders a read after it, and the outputs stay poisoned)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def put(self, work: "StrictWork") -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"strict-stream-{self.name}", daemon=True)
            self.thread.start()
        self.queue.put(work)

    def _run(self) -> None:
        while True:
            self.queue.get()._arrive()


class _Group:
    """The ops of one `batch_isend_irecv`: NCCL runs a group as one kernel, so they progress together
    (waited one after another, a group whose sends only move inside gloo's wait() would deadlock)."""

    def __init__(self, works: list["StrictWork"]) -> None:
        self.works = works

    def _arrive(self) -> None:
        helpers = [threading.Thread(target=w._wait_inner, daemon=True) for w in self.works[1:]]
        for t in helpers:
            t.start()
        if self.works:
            self.works[0]._wait_inner()
        for t in helpers:
            t.join()
        for w in self.works:
            w._arrived()


_GROUPING: list[list["StrictWork"]] = []   # while a batch_isend_irecv issues its ops: the group's works


class StrictWork(dist.Work):
    """One strict op: gloo's Work on private buffers; the real outputs poisoned until it completes."""

    def __init__(self, name: str, inner: Any, outputs: list[torch.Tensor], privates: list[torch.Tensor],
                 stall_s: float, rank: int, stream: _Stream) -> None:
        super().__init__()
        self.name, self.inner, self.outputs, self.privates, self.stream = name, inner, outputs, privates, stream
        self.stall_s, self.rank, self.seq, self.issued_at = stall_s, rank, next(_SEQ), _issuer()
        self._lock = threading.Lock()
        self.joined = False          # wait() was called: reads are ordered after the op (a GPU's stream)
        self.arrived = False         # gloo finished it (the bytes are in the private buffers)
        self.done = False            # the result is in the real outputs
        self.error: BaseException | None = None
        self._done = threading.Event()
        self.spans = [_span(o) for o in outputs if o.numel()]
        with _LOCK:
            _PENDING.works.append(self)
        if _GROUPING:
            _GROUPING[-1].append(self)
        else:
            stream.put(self)

    def describe(self) -> str:
        shapes = ", ".join(str(tuple(o.shape)) for o in self.outputs[:3]) or "no output"
        return f"{self.name} #{self.seq} (outputs {shapes}) issued at {self.issued_at}"

    def _arrive(self) -> None:
        """On the stream's thread: wait for gloo; copy the result in if the op is joined."""
        self._wait_inner()
        self._arrived()

    def _wait_inner(self) -> None:
        try:
            self.inner.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's thread by complete()
            self.error = exc

    def _arrived(self) -> None:
        with self._lock:
            self.arrived = True
            if self.joined or self.error is not None:
                self._finish()

    def _finish(self) -> None:
        """Under self._lock, once arrived: the result into the outputs, the op off the pending list."""
        if self.done:
            return
        if self.error is None:
            # No mode sees the copy: it is the op's own completion, not a read (StreamOrder would wait for it).
            with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
                for out, priv in zip(self.outputs, self.privates):
                    if priv is not out:
                        out.data.copy_(priv)
        self.done = True
        self.privates = []
        with _LOCK:
            if self in _PENDING.works:
                _PENDING.works.remove(self)
        self._done.set()

    def complete(self) -> None:
        """Block until the result is in the outputs, spinning (as a CPU thread behind a CUDA kernel does:
        a CPU-time monitor counts this rank as working). Raises `StrictStall` after the stall window."""
        if not self.done:
            self.wait()
            deadline = time.monotonic() + self.stall_s
            while not self._done.is_set():
                time.sleep(0.0002)
                if time.monotonic() > deadline:
                    with _LOCK:
                        if self in _PENDING.works:
                            _PENDING.works.remove(self)
                    raise StrictStall(
                        f"rank {self.rank}: {self.describe()} did not complete within the stall window "
                        f"({self.stall_s:g} s): a peer never joined it (a collective some ranks skip, a recv "
                        "without its send, ranks issuing ops in different orders). On NCCL this rank would spin "
                        "at 100% CPU and the process group's watchdog would report the same op.")
        if self.error is not None:
            raise self.error

    # dist.Work's interface, with NCCL's meaning.
    def wait(self, timeout: Any = None) -> bool:
        """Order later reads after the op; do not block the host (NCCL's `wait()` syncs streams, not
        the CPU)."""
        if not self.joined:
            with self._lock:
                self.joined = True
                if self.arrived:
                    self._finish()
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done and self.error is None

    def exception(self) -> Any:
        return self.error

    def source_rank(self) -> int:
        return self.inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self.outputs

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """C++ callers (DDP's reducer) chain on the future: it completes (results copied in) in gloo's
        thread when the op is done, as a CUDA future completes on NCCL's stream."""
        self.wait()

        def done(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.wait()
            with self._lock:
                self.arrived = True
                self._finish()
            return self.outputs
        return self.inner.get_future().then(done)


class StreamOrder(TorchDispatchMode):
    # As distlab's meters (distlab.meters.dispatch.EagerMode): used as written, no torch._dynamo import.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    """A torch op that touches the output of a joined strict op first completes it: a GPU stream's
    order. An unjoined (async, not yet waited) op's output is left poisoned."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _PENDING.works:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            waited = [r for r in map(_collective_result, leaves) if r is not None]
            if waited:      # this op's first act is wait_tensor on them (AsyncCollectiveTensor's dispatch)
                _PENDING.complete_joined(waited, join=True)
            _PENDING.complete_joined(leaves)
        return func(*args, **kwargs)


class HostReads(TorchFunctionMode):
    """The reads that reach memory without a torch op (`.tolist()`, `.numpy()`, pickling): on a GPU each is
    a copy to the host, ordered after the tensor's pending ops like any other."""

    READS = {"tolist", "numpy", "__array__", "__reduce_ex__", "__getstate__", "__deepcopy__"}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _PENDING.works and getattr(func, "__name__", "") in self.READS:
            _PENDING.complete_joined(_flat(list(args)))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------
# The process group


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


def _private(x: Any, keep: bool) -> Any:
    """A private twin of every tensor in `x` (a copy if `keep`: in-place ops read their output)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone() if keep else torch.empty_like(x)
    if isinstance(x, (list, tuple)):
        return [_private(v, keep) for v in x]
    return x


class StrictBackend(dist.ProcessGroup):
    """gloo underneath, NCCL's rules on top (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.stall_s = STALL_S if STALL_S is not None else timeout.total_seconds()
        # gloo connects with the group's (long) timeout: ranks may start seconds apart on a busy machine.
        # Its ops then time out after the stall window, as NCCL's watchdog does when the group's timeout
        # is the stall window.
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        gloo._set_default_timeout(timedelta(seconds=self.stall_s + 5))
        # Called through a C++ ProcessGroup, each op is a c10d dispatcher op (torch.ops.c10d.allreduce_, ...):
        # the comm meter sees and books it exactly as it books gloo's.
        self.inner = dist.ProcessGroup(store, rank, size)
        self.inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        self.stream = _Stream(f"{rank}-{next(_STREAMS)}")

    def getBackendName(self) -> str:
        return STRICT_BACKEND

    # A Python process group keeps its own name (torch's ProcessGroup keeps it on its C++ backends, which this
    # one has none of): DeviceMesh and the functional collectives find groups by name.
    _group_name = ""
    _group_desc = ""

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        # The c10d ops the meters see carry the inner group: under this group's name, it resolves to this one.
        self.inner._set_group_name(name)

    setGroupName = _set_group_name

    def getGroupName(self) -> str:
        return self._group_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    setGroupDesc = _set_group_desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def _run(self, name: str, out_pos: int | None, in_place: bool, args: tuple) -> StrictWork:
        args = list(args)
        # Ops on one group run in issue order on NCCL's stream: a joined op whose outputs this one touches
        # completes first (the bytes it reads or overwrites are the earlier op's results).
        _PENDING.complete_joined(_flat(args))
        # The private buffers are the emulation's, not the program's: made where no meter sees them.
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            outputs = _flat(args[out_pos]) if out_pos is not None else []
            privates_tree = _private(args[out_pos], keep=in_place) if out_pos is not None else None
            # The op reads its inputs where they stand at issue: a later op that overwrites them (a recv into the
            # buffer just sent) runs after this one on NCCL's stream, so a snapshot gives the same bytes.
            args = [a if i == out_pos else _private(a, keep=True) for i, a in enumerate(args)]
        if out_pos is not None:
            args[out_pos] = privates_tree
        with torch._C.DisableTorchFunction():
            inner = getattr(self.inner, name)(*args)
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            for o in outputs:
                _poison(o)
        return StrictWork(name, inner, outputs, _flat(privates_tree) if privates_tree is not None else [],
                          self.stall_s, self._rank, self.stream)

    # Collectives. The output argument (position) is poisoned until the op completes.
    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", 0, True, (tensors,) + ((opts,) if opts is not None else ()))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._run("allreduce_coalesced", 0, True, (tensors,) + ((opts,) if opts is not None else ()))

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", 0, True, (tensors,) + ((opts,) if opts is not None else ()))

    def reduce(self, tensors, opts=None):
        return self._run("reduce", 0, True, (tensors,) + ((opts,) if opts is not None else ()))

    def allgather(self, output_lists, inputs, opts=None):
        return self._run("allgather", 0, False, (output_lists, inputs) + ((opts,) if opts else ()))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._run("allgather_coalesced", 0, False, (output_lists, inputs) + ((opts,) if opts else ()))

    def all_gather_single(self, output, input, opts=None):
        return self._run("_allgather_base", 0, False, (output, input) + ((opts,) if opts else ()))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return GroupWork(works) if len(works) != 1 else works[0]

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._run("reduce_scatter", 0, False, (outputs, input_lists) + ((opts,) if opts else ()))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run("_reduce_scatter_base", 0, False, (output, input) + ((opts,) if opts else ()))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return GroupWork(works) if len(works) != 1 else works[0]

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("alltoall", 0, False, (outputs, inputs) + ((opts,) if opts else ()))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        return self._run("alltoall_base", 0, False,
                         (output, input, output_splits, input_splits) + ((opts,) if opts else ()))

    alltoall_base = all_to_all_single

    def gather(self, output_lists, inputs, opts=None):
        return self._run("gather", 0, False, (output_lists, inputs) + ((opts,) if opts else ()))

    def scatter(self, outputs, input_lists, opts=None):
        return self._run("scatter", 0, False, (outputs, input_lists) + ((opts,) if opts else ()))

    def send(self, tensors, dst, tag=0):
        return self._run("send", None, False, (tensors, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._run("recv", 0, False, (tensors, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._run("recv_anysource", 0, False, (tensors, tag))

    def barrier(self, opts=None):
        # On NCCL a barrier is an all-reduce followed by a device synchronisation: everything before it
        # completes, and so does the barrier itself, before the host goes on.
        _PENDING.complete_all()
        work = self._run("barrier", None, False, ((opts,) if opts is not None else ()))
        work.complete()
        return work


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> StrictBackend:
    return StrictBackend(store, rank, size, timeout)


def register() -> None:
    """Make `dist.init_process_group("strict")` available (idempotent)."""
    if STRICT_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(STRICT_BACKEND, _create, devices=["cpu"])


def requested() -> bool:
    """True when $DISTLAB_STRICT asks every CPU launch to run on the strict backend."""
    import os
    return os.environ.get("DISTLAB_STRICT", "0") not in ("", "0", "false", "False")


def is_strict() -> bool:
    return dist.is_initialized() and dist.get_backend() == STRICT_BACKEND


def synchronize() -> None:
    """What `torch.cuda.synchronize()` does to NCCL's queued ops: every one completes."""
    _PENDING.complete_all()


@contextlib.contextmanager
def strict_rank() -> Iterator[None]:
    """The rules on this rank's side while `fn` runs: stream order, one Work per p2p group."""
    with StreamOrder(), HostReads(), one_work_per_p2p_group():
        yield
    _PENDING.complete_all()   # as a GPU's queued work completes before the process exits


__all__ = ["GroupWork", "one_work_per_p2p_group", "StrictBackend", "StrictWork", "StrictStall", "StreamOrder",
           "HostReads", "register", "requested", "is_strict", "synchronize", "strict_rank", "STRICT_BACKEND"]
del sys
