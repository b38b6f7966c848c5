"""Unpickling what learner processes produced, without ever running their code.

Everything a rank hands back (results, error reports) was written by a
process that ran learner code, so it is read with `safe_loads`: an
unpickler that resolves only an explicit list of classes and functions
(containers, numbers, CPU tensors rebuilt by torch, dtypes, sizes, devices,
and distlab's meter snapshots). A learner's class, a function, or a
`__reduce__` trick is refused with `UnsafeResult`; the check then fails,
and nothing of the learner's runs in the grader. Never call
`cloudpickle.loads` / `pickle.loads` on such bytes.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

MAX_BYTES = 256 << 20     # one rank's pickled outputs; a check's outputs are kilobytes to megabytes


class UnsafeResult(pickle.UnpicklingError):
    """The bytes name something the grader does not unpickle, or are not a pickle at all."""


def _load_storage(data: bytes) -> Any:
    """torch.storage._load_from_bytes without weights_only=False (which would run any pickle)."""
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


def _allowed() -> dict[tuple[str, str], Any]:
    import collections

    import torch
    import torch._utils

    from distlab.meters.comm import CommStats
    from distlab.meters.memory import MemoryStats, ModelState
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
        ("torch.storage", "_load_from_bytes"): _load_storage,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("distlab.meters.comm", "CommStats"): CommStats,
        ("distlab.meters.memory", "MemoryStats"): MemoryStats,
        ("distlab.meters.memory", "ModelState"): ModelState,
    }
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table["torch", name] = value
    for name in ("list", "dict", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes",
                 "bytearray", "bool", "slice"):
        table["builtins", name] = getattr(__import__("builtins"), name)
    return table


_TABLE: dict[tuple[str, str], Any] | None = None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        global _TABLE
        if _TABLE is None:
            _TABLE = _allowed()
        try:
            return _TABLE[module, name]
        except KeyError:
            raise UnsafeResult(
                f"the ranks returned a {module}.{name}, which the grader does not unpickle "
                "(only tensors, numbers, strings, containers and distlab's meter snapshots)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeResult("the ranks returned a pickle with persistent ids")


def safe_loads(data: bytes) -> Any:
    """Unpickle `data` from a learner process; raise UnsafeResult for anything outside the list."""
    if not isinstance(data, (bytes, bytearray)):
        raise UnsafeResult(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise UnsafeResult(f"the ranks returned {len(data) >> 20} MiB (limit {MAX_BYTES >> 20} MiB)")
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeResult:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or garbled bytes
        raise UnsafeResult(f"unreadable result ({type(exc).__name__}: {str(exc)[:100]})") from None
