"""Reading the launcher's per-rank files in the sandbox runner: plain data only, in bounded time.

`distlab.launch` hands a rank's return value and error report over as
pickles, and a rank runs learner code, which can write anything into those
files (or replace the function that writes them). The grader itself never
reads a pickle (a rank's outputs reach it as safetensors + JSON, see
`distlab.grading.wire`); the runner reads these with `plain_loads`, which
first walks the opcodes (at most `MAX_OPS`) and refuses every opcode outside
a short list: no globals (so nothing is called), no tuples, sets or frozensets
(so nothing is hashed but strings: no hash bomb), no memo reads (so no shared
sub-objects: memory stays linear in the size). What passes is bytes, strings,
numbers, None, booleans, lists and dicts keyed by those: `UnsafeResult` for
anything else.
"""
from __future__ import annotations

import pickle
import pickletools
from typing import Any

MAX_BYTES = 40 << 20      # a rank's pickled result: its outputs (resultcheck.MAX_BLOB) and a little framing
MAX_OPS = 100_000
ALLOWED = frozenset({
    "PROTO", "FRAME", "STOP", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "MARK",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "BINFLOAT", "FLOAT",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING",
    "EMPTY_LIST", "LIST", "APPEND", "APPENDS", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
})


class UnsafeResult(pickle.UnpicklingError):
    """The bytes hold something outside plain data, are too large, or are not a pickle at all."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeResult(f"the ranks returned a {module}.{name}, which the grader does not read")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeResult("the ranks returned a pickle with persistent ids")


def plain_loads(data: bytes) -> Any:
    """Unpickle `data` from a learner process if it holds plain data only (see the module docstring)."""
    if not isinstance(data, (bytes, bytearray)):
        raise UnsafeResult(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise UnsafeResult(f"the rank returned {len(data) >> 20} MiB (limit {MAX_BYTES >> 20} MiB)")
    try:
        for count, (op, _, _) in enumerate(pickletools.genops(bytes(data))):
            if count >= MAX_OPS:
                raise UnsafeResult(f"the rank returned a pickle of more than {MAX_OPS} operations")
            if op.name not in ALLOWED:
                raise UnsafeResult(f"the rank returned a pickle with the operation {op.name}, which the "
                                   "grader does not read (only plain bytes, strings, numbers, lists and dicts)")
        return _Unpickler(__import__("io").BytesIO(data)).load()
    except UnsafeResult:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or garbled bytes
        raise UnsafeResult(f"unreadable result ({type(exc).__name__}: {str(exc)[:100]})") from None
