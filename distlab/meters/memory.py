"""Per-rank memory: current and peak bytes, and what a rank holds at a step boundary.

On CUDA the allocator's own statistics are used (they include its 512-byte
rounding). On CPU there is no such allocator, so `track_memory` counts live
tensor storages exactly: a `TorchDispatchMode` sees every op, records each
output storage that did not exist before (views and in-place results alias
an input and are skipped; storages made before tracking began are never
counted), and a weak reference tells it when the storage is freed.

FSDP2 parameters are DTensors (a wrapper with no storage of its own): the
tracker counts the rank-local tensor inside. FSDP2 also frees and re-creates
unsharded parameters with `untyped_storage().resize_()`, which is not a
dispatcher op: while tracking, `resize_` is wrapped so that each resize is
booked as a free of the old bytes and an allocation of the new ones (freeing
a storage made before tracking began lowers `current_bytes` below zero, as
CUDA's counters would).

A collective's own hold on a tensor is not the program's. gloo's worker thread marks an op done (so
`wait()` returns) and only then drops the op, which holds the op's tensors: a temporary the program
dropped right after a synchronous collective (`all_gather(out, shard.clone())`) stays alive a moment
longer, and an allocation in that moment would count it (measured: the last reference is the
worker's in about a quarter of such calls). The tracker books such a storage -- one handed to a c10d
op (or to a functional collective, DTensor's, whose completion is its `wait_tensor`) and freed by a
thread other than the program's -- as freed when its op completed, and lowers the peak of every
moment after that completion by its bytes. A read (`peak_bytes`, `current_bytes`, `stats()`,
`reset_peak()`) first gives that thread a moment to finish (`_settle`: 50 ms after the op at most).

What the CPU tracker cannot see: storages created outside the dispatcher
(`torch.from_numpy`, unpickling, buffers private to a C++ library such as
gloo's send/recv staging), and memory that is not a tensor (Python objects,
the CUDA context).
"""
from __future__ import annotations

import sys
import threading
import time
import warnings
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils._pytree import tree_leaves

from distlab.meters.dispatch import EagerMode

# A simulation (fake tensors, `distlab.course.sim`) is booked by its storages' addresses, as a real run is: torch
# warns that a fake tensor's address is deprecated, once per process, into the learner's notebook. Only that one.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor is deprecated")


@dataclass(frozen=True)
class MemoryStats:
    """A picklable snapshot: bytes allocated inside the tracked region."""

    current_bytes: int
    peak_bytes: int


class _StorageTracker(EagerMode):
    """Counts bytes of storages born inside the mode, until each is freed."""

    HOLD_S = 5.0    # a backend that drops an op's tensors later than this after completion is not corrected
    GRACE_S = 0.05  # how long a read waits for the backend to drop the tensors of an op that just completed

    def __init__(self, book_frees: bool = False) -> None:
        super().__init__()
        # book_frees: as CUDA's allocator counters do, a storage made before the block that the block frees
        # counts as minus its bytes (the strict backend's ranks measure as a GPU would).
        self.book_frees = book_frees
        self._current = 0
        self._peak = 0
        self._live: dict[int, int] = {}  # storage data_ptr -> nbytes
        self._preexisting: set[int] = set()
        # Finalizers run on whichever thread drops a storage's last reference (gloo's worker, too).
        self._lock = threading.RLock()
        self._program = threading.get_ident()
        self._seq = 0                            # moments: allocations, op completions, resets
        self._completed: dict[int, tuple[int, float]] = {}  # key -> (moment its c10d op completed, when)
        self._log: deque[list[int]] = deque()    # [moment, current bytes] since the oldest of those
        self._floor = 0                          # the phase's peak before the log's first moment
        self._recent: deque[tuple[float, list[Any]]] = deque()  # (when, weakrefs to the op's tensors)
        self._functional: dict[int, tuple[list[int], list[Any]]] = {}  # output key -> its op's tensors

    # ---- what a reader sees -----------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        self._settle()
        return self._current

    @property
    def peak_bytes(self) -> int:
        self._settle()
        return self._peak

    def reset_peak(self) -> None:
        """From now on, the peak is measured from the current bytes (the peak of one phase)."""
        self._settle()
        with self._lock:
            self._seq += 1
            self._peak = self._floor = self._current
            self._log.clear()
            if self._completed:
                self._log.append([self._seq, self._current])
                self._floor = 0

    def stats(self) -> MemoryStats:
        self._settle()
        return MemoryStats(self._current, self._peak)

    # ---- booking ----------------------------------------------------------------------------

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self._current -= nbytes
            done = self._completed.pop(key, None)
            self._functional.pop(key, None)
            if done is not None and nbytes and threading.get_ident() != self._program:
                # The backend's thread held the last reference: the program had let go by the time
                # the op completed. Book the free at that moment.
                for moment in self._log:
                    if moment[0] > done[0]:
                        moment[1] -= nbytes
                self._peak = max([self._floor] + [c for _, c in self._log])
            self._trim()

    def _booked(self) -> None:
        """After the current bytes grew: the peak, and the log while an op's tensors may be held by it."""
        self._seq += 1
        self._peak = max(self._peak, self._current)
        if self._completed:
            self._log.append([self._seq, self._current])
            self._trim()

    def _trim(self) -> None:
        """Forget completions older than HOLD_S, and the moments no completion can correct."""
        now = time.monotonic()
        while self._completed:
            key, (moment, when) = next(iter(self._completed.items()))
            if now - when < self.HOLD_S:
                break
            del self._completed[key]
        oldest = next(iter(self._completed.values()))[0] if self._completed else None
        while self._log and (oldest is None or self._log[0][0] <= oldest):
            self._floor = max(self._floor, self._log.popleft()[1])

    def _remember_preexisting(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key not in self._preexisting:
            self._preexisting.add(key)
            # Once freed, the address may be reused by a storage we must count.
            weakref.finalize(storage, self._forget_preexisting, key, storage.nbytes())

    def _forget_preexisting(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._preexisting.discard(key)
            if self.book_frees:
                self._current -= nbytes

    def _note(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        with self._lock:
            if key == 0 or key in self._live or key in self._preexisting:
                return
            nbytes = storage.nbytes()
            self._live[key] = nbytes
            self._current += nbytes
            self._booked()
        weakref.finalize(storage, self._release, key)

    # ---- a collective's hold on the program's tensors ----------------------------------------

    def _held(self, tensors: list[torch.Tensor]) -> tuple[list[int], list[Any]] | None:
        """What an op's tensors leave to watch: the keys of the storages this tracker counts, and weak
        references to the tensors (for `_settle`); None when there is nothing to correct. A fake tensor
        (a simulation) has no backend thread to wait for."""
        from torch._subclasses.fake_tensor import FakeTensor
        if any(isinstance(t, FakeTensor) for t in tensors):
            return None
        keys = [k for k in (_local(t).untyped_storage().data_ptr() for t in tensors) if k in self._live]
        return (keys, [weakref.ref(t) for t in tensors]) if keys else None

    def _watch(self, out: Any, tensors: list[torch.Tensor]) -> None:
        """When the c10d op whose result is `out` completes, remember its tensors' storages (`_on_complete`)."""
        held = self._held(tensors)
        works = [w for w in tree_leaves(out) if isinstance(w, torch.ScriptObject)]
        if held is None or not works:
            return
        from torch.distributed import Work
        try:
            future = Work.unbox(works[-1]).get_future()
        except (RuntimeError, TypeError, AttributeError):
            return  # a Work without a future: nothing to correct
        me = weakref.ref(self)

        def done(_: Any) -> None:
            tracker = me()
            if tracker is not None:
                tracker._on_complete(*held)
        future.add_done_callback(done)

    def _watch_functional(self, func: Any, out: Any, leaves: list[torch.Tensor]) -> None:
        """A functional collective (DTensor's) returns its output and keeps its Work to itself until
        `wait_tensor(output)`, whose return is the completion the program sees: its tensors (the op's
        inputs and outputs) are remembered then."""
        if func is torch.ops._c10d_functional.wait_tensor.default:
            waited = self._functional.pop(_local(leaves[0]).untyped_storage().data_ptr(), None) if leaves else None
            if waited is not None:
                self._on_complete(*waited)
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        held = self._held(leaves + outs)
        if held is not None:
            for t in outs:
                self._functional[_local(t).untyped_storage().data_ptr()] = held

    def _on_complete(self, keys: list[int], refs: list[Any]) -> None:
        with self._lock:
            self._seq += 1
            if not self._completed:
                self._floor = self._peak
            for key in keys:
                if key in self._live:
                    self._completed.pop(key, None)   # re-inserted: the dict stays oldest first
                    self._completed[key] = (self._seq, time.monotonic())
            self._recent.append((time.monotonic(), refs))

    def _settle(self) -> None:
        """Before a read: give the backend's thread a moment (GRACE_S after the op completed, at most) to
        drop the tensors of a just-completed op that the program may no longer hold (`_maybe_held_by_backend`).

        Dropping a tensor's last C++ reference takes the GIL (torch releases the Python object then), so
        a thread that dropped one may be waiting for the GIL, which the read gives away while it waits."""
        while True:
            with self._lock:
                now = time.monotonic()
                while self._recent and now - self._recent[0][0] >= self.GRACE_S:
                    self._recent.popleft()
                waiting = any(_maybe_held_by_backend(r) for _, refs in self._recent for r in refs)
            if not waiting:
                return
            time.sleep(0.001)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.book_frees and func.namespace == "c10d":
            # On the strict backend a c10d op's tensors are its private buffers, not the program's.
            return func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        inputs = {_local(t).untyped_storage().data_ptr() for t in leaves}
        if self.book_frees:
            for t in leaves:
                storage = _local(t).untyped_storage()
                if storage.data_ptr() not in self._live and storage.nbytes():
                    self._remember_preexisting(storage)
        out = func(*args, **kwargs)
        if func.namespace == "c10d":
            self._watch(out, leaves)
        elif func.namespace == "_c10d_functional":
            self._watch_functional(func, out, leaves)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = _local(t).untyped_storage()
                key = storage.data_ptr()
                if key in inputs and key not in self._live:
                    # Output aliases an input we did not create: a view or an
                    # in-place op on a pre-existing tensor. Not a new allocation.
                    self._remember_preexisting(storage)
                    continue
                self._note(storage)
        return out

    def on_resize(self, old_key: int, old_bytes: int, storage: torch.UntypedStorage) -> None:
        """Book `storage.resize_()`: the old bytes are freed, the new ones allocated."""
        with self._lock:
            if old_key in self._live:
                self._release(old_key)
            elif old_bytes:
                self._current -= old_bytes
            key = storage.data_ptr()
            if not storage.nbytes() or key in self._live:
                return
            self._live[key] = storage.nbytes()
            self._current += storage.nbytes()
            self._booked()
        weakref.finalize(storage, self._release, key)


def _maybe_held_by_backend(ref: Any) -> bool:
    """Whether the tensor behind `ref` may be alive only because a backend's thread has not finished
    dropping it: no Python reference of the program's but the TensorImpl's own (C++ still holds it: a
    finished op the backend has not dropped, also autograd or a view's base), or one (the program's, or the
    TensorImpl's in the moment after C++ dropped its last reference and before that thread got the GIL to
    release the Python object: the two cannot be told apart)."""
    t = ref()
    # references to the object: `t`, getrefcount's argument, and the one above
    return t is not None and sys.getrefcount(t) <= 3


@contextmanager
def _booking_resizes(tracker: _StorageTracker) -> Iterator[None]:
    """Wrap `UntypedStorage.resize_` for the block so the tracker sees resizes."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old_key, old_bytes = storage.data_ptr(), storage.nbytes()
        out = original(storage, size)
        if storage.device.type == "cpu":
            tracker.on_resize(old_key, old_bytes, storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


class _CudaTracker:
    """Same interface from the CUDA caching allocator's counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        self._base = torch.cuda.memory_allocated(device)

    @property
    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self._base

    @property
    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self._base

    def reset_peak(self) -> None:
        """From now on, the peak is measured from the current bytes (the peak of one phase)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stats(self) -> MemoryStats:
        torch.cuda.synchronize(self.device)
        return MemoryStats(self.current_bytes, self.peak_bytes)


@contextmanager
def track_memory(device: torch.device | str | None = None) -> Iterator[Any]:
    """Measure bytes allocated inside the block: `.current_bytes`, `.peak_bytes`, `.stats()`,
    `.reset_peak()` (start a new phase).

    On the strict backend's CPU ranks the meter books as CUDA's counters do: a
    storage made before the block and freed in it counts as minus its bytes.

    `device` defaults to this rank's device (`distlab.device()`). On CUDA the
    figures are the caching allocator's (blocks rounded to 512 B, plus
    workspaces cuBLAS/NCCL allocate on first use): run one step before the
    block to warm up, and compare with a tolerance, or compare model states
    (`model_state`), which are exact on every device.
    """
    from distlab.engine.runtime import device as rank_device
    dev = torch.device(device) if device is not None else rank_device()
    if dev.type == "cuda":
        yield _CudaTracker(dev)
        return
    from distlab.engine.strict import is_strict
    with _StorageTracker(book_frees=is_strict()) as tracker, _booking_resizes(tracker):
        yield tracker


@dataclass(frozen=True)
class ModelState:
    """Bytes a rank holds, by role. Storages shared between roles count once, in the first."""

    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a tensor's bytes: the rank-local tensor behind a DTensor (FSDP2's
    sharded parameters, TP's shards), the result inside an AsyncCollectiveTensor (what DTensor's
    collectives return before they are waited on); other wrappers by their first inner tensor."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    while is_traceable_wrapper_subclass(t):
        inner = getattr(t, t.__tensor_flatten__()[0][0])
        if not isinstance(inner, torch.Tensor):
            break
        t = inner
    return t


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return [v for state in obj.state.values() for v in tree_leaves(state) if isinstance(v, torch.Tensor)]
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        s = _local(t).untyped_storage()
        key = (str(t.device), s.data_ptr())
        if s.data_ptr() == 0 or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def model_state(params: Any, grads: Any = None, optimizer: Any = None) -> ModelState:
    """What a rank holds at a step boundary, walking the live objects.

    `params`: a module or tensors; `grads`: tensors (default: the `.grad` of
    `params`); `optimizer`: a torch optimizer (its `state`) or tensors.
    Counts whole storages: a view into a flat buffer counts the buffer once.
    """
    seen: set[tuple[str, int]] = set()
    p_list = list(_tensors(params))
    g_list = [p.grad for p in p_list if p.grad is not None] if grads is None else list(_tensors(grads))
    return ModelState(_storage_bytes(p_list, seen), _storage_bytes(g_list, seen),
                      _storage_bytes(_tensors(optimizer), seen))


def storages(*roots: Any, depth: int = 3, optimizer_groups: bool = False) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from `roots`, (device, address) -> bytes, each storage once.

    Walks tensors (and their `.grad`; a DTensor's local shard), modules
    (parameters, buffers), optimizers (their state; with `optimizer_groups`,
    their param_groups too), dicts, lists, tuples, sets and plain objects'
    attributes, up to `depth` levels. (The one walker: `held_bytes` here, and
    `distlab.course.offload.host_device_split`.)
    """
    seen: dict[tuple[str, int], int] = {}
    stack = [(r, 0) for r in roots]
    visited: set[int] = set()
    while stack:
        obj, d = stack.pop()
        if isinstance(obj, torch.Tensor):
            for u in (obj, obj.grad):
                if isinstance(u, torch.Tensor):
                    s = _local(u).untyped_storage()
                    key = (str(u.device), s.data_ptr())
                    if s.data_ptr():
                        seen[key] = max(seen.get(key, 0), s.nbytes())
            continue
        if id(obj) in visited or d > depth or isinstance(obj, (str, bytes, int, float, type)):
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            stack += [(t, d + 1) for t in list(obj.parameters()) + list(obj.buffers())]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [(v, d + 1) for v in obj.state.values()]
            if optimizer_groups:
                stack += [(g, d + 1) for g in obj.param_groups]
        elif isinstance(obj, dict):
            stack += [(v, d + 1) for v in list(obj.keys()) + list(obj.values())]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(v, d + 1) for v in obj]
        elif hasattr(obj, "__dict__"):
            stack += [(v, d + 1) for v in vars(obj).values()]
    return seen


def held_bytes(*roots: Any, depth: int = 3) -> int:
    """Bytes of every tensor storage reachable from `roots`, each storage once (`storages`): what these
    objects keep alive between steps, on whatever device they live."""
    return sum(storages(*roots, depth=depth).values())
