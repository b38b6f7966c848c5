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

What the CPU tracker cannot see: storages created outside the dispatcher
(`torch.from_numpy`, unpickling, buffers private to a C++ library such as
gloo's send/recv staging), and memory that is not a tensor (Python objects,
the CUDA context).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils._pytree import tree_leaves

from distlab.meters.dispatch import EagerMode


@dataclass(frozen=True)
class MemoryStats:
    """A picklable snapshot: bytes allocated inside the tracked region."""

    current_bytes: int
    peak_bytes: int


class _StorageTracker(EagerMode):
    """Counts bytes of storages born inside the mode, until each is freed."""

    def __init__(self, book_frees: bool = False) -> None:
        super().__init__()
        # book_frees: as CUDA's allocator counters do, a storage made before the block that the block frees
        # counts as minus its bytes (the strict backend's ranks measure as a GPU would).
        self.book_frees = book_frees
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}  # storage data_ptr -> nbytes
        self._preexisting: set[int] = set()

    def _release(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def _remember_preexisting(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key not in self._preexisting:
            self._preexisting.add(key)
            # Once freed, the address may be reused by a storage we must count.
            weakref.finalize(storage, self._forget_preexisting, key, storage.nbytes())

    def _forget_preexisting(self, key: int, nbytes: int) -> None:
        self._preexisting.discard(key)
        if self.book_frees:
            self.current_bytes -= nbytes

    def _note(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._live or key in self._preexisting:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.book_frees and func.namespace == "c10d":
            # On the strict backend a c10d op's tensors are its private buffers, not the program's.
            return func(*args, **kwargs)
        inputs = {_local(t).untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        if self.book_frees:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storage = _local(t).untyped_storage()
                    if storage.data_ptr() not in self._live and storage.nbytes():
                        self._remember_preexisting(storage)
        out = func(*args, **kwargs)
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
        if old_key in self._live:
            self._release(old_key)
        elif old_bytes:
            self.current_bytes -= old_bytes
        key = storage.data_ptr()
        if storage.nbytes() and key not in self._live:
            self._live[key] = storage.nbytes()
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            weakref.finalize(storage, self._release, key)

    def reset_peak(self) -> None:
        """From now on, the peak is measured from the current bytes (the peak of one phase)."""
        self.peak_bytes = self.current_bytes

    def stats(self) -> MemoryStats:
        return MemoryStats(self.current_bytes, self.peak_bytes)


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


def held_bytes(*roots: Any, depth: int = 3) -> int:
    """Bytes of every tensor storage reachable from `roots`, each storage once.

    Walks tensors (and their `.grad`), modules (parameters, buffers),
    optimizers (their state), dicts, lists, tuples, sets and plain objects'
    attributes, up to `depth` levels: what these objects keep alive between
    steps, on whatever device they live.
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
        if id(obj) in visited or d > depth:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            stack += [(t, d + 1) for t in list(obj.parameters()) + list(obj.buffers())]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [(v, d + 1) for v in obj.state.values()]
        elif isinstance(obj, dict):
            stack += [(v, d + 1) for v in list(obj.keys()) + list(obj.values())]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(v, d + 1) for v in obj]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack += [(v, d + 1) for v in vars(obj).values()]
    return sum(seen.values())
