"""Bounds on a rank's result, checked before the grader parses it: standard library only.

A rank's outputs reach the grader as one safetensors file (see
`distlab.grading.wire`): an 8-byte header length, a JSON header naming each
tensor's dtype, shape and byte range, the raw bytes, and in the header's
`__metadata__` the outputs' structure as JSON (`"distlab"`). A learner's
process wrote those bytes, so they may be anything. `problem(blob)` returns
'' when they respect every bound (sizes, byte ranges that tile the data,
the structure's schema, depth and node count), else one line saying what
does not. Every step is linear in the size, and no hashable container is
built from the data, so nothing here can be made to run long; even so the
grader runs it in a child process with a deadline and a memory limit
(`check_in_child`), and parses a result itself only after the child passed it.

    python -I -S resultcheck.py < framed blobs     # the child: prints a JSON list of problems
"""
from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys

MAX_BLOB = 32 << 20            # one rank's outputs for one case; a check's outputs are kilobytes
MAX_HEADER = 8 << 20           # the JSON header, structure included
MAX_TENSORS = 20_000
MAX_NODES = 200_000
MAX_DEPTH = 12
MAX_STR = 1 << 16
# safetensors dtype -> bytes per element (the ones a check's outputs use)
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# torch dtypes a result may name as values ({"dtype": name})
TORCH_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                          "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"})
# the dataclasses a result may hold, with their fields (all ints)
RECORDS = {"MemoryStats": ("current_bytes", "peak_bytes"), "ModelState": ("params", "grads", "optimizer_state")}
TAGS = frozenset({"list", "tuple", "dict", "tensor", "dtype", "size", "region", "record"})


class Malformed(ValueError):
    """The bytes break a bound; the message is the one-line reason."""


def split(blob: bytes) -> tuple[dict, dict, int]:
    """(tensor entries, metadata, offset of the data); Malformed unless the header is well formed."""
    if len(blob) > MAX_BLOB:
        raise Malformed(f"{len(blob) >> 20} MiB of outputs (limit {MAX_BLOB >> 20} MiB)")
    if len(blob) < 8:
        raise Malformed("not a result (shorter than its header)")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if n > MAX_HEADER or 8 + n > len(blob):
        raise Malformed("not a result (its header length is out of bounds)")
    try:
        header = json.loads(bytes(blob[8:8 + n]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"not a result (its header is not JSON: {type(exc).__name__})") from None
    if type(header) is not dict:
        raise Malformed("not a result (its header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    if type(meta) is not dict or type(meta.get("distlab")) is not str:
        raise Malformed("not a result (no distlab structure in its metadata)")
    if len(header) > MAX_TENSORS:
        raise Malformed(f"more than {MAX_TENSORS} tensors")
    return header, meta, 8 + n


def _check_tensors(entries: dict, data_bytes: int) -> None:
    spans = []
    for name, e in entries.items():
        if type(e) is not dict or set(e) != {"dtype", "shape", "data_offsets"}:
            raise Malformed(f"tensor {name[:40]!r}: not a tensor entry")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if type(dtype) is not str or dtype not in DTYPES or type(shape) is not list or len(shape) > 8 or type(offsets) is not list \
                or len(offsets) != 2:
            raise Malformed(f"tensor {name[:40]!r}: bad dtype, shape or byte range")
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise Malformed(f"tensor {name[:40]!r}: bad shape")
            count *= d
            if count > data_bytes:
                raise Malformed(f"tensor {name[:40]!r}: larger than the data")
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= data_bytes \
                or end - begin != count * DTYPES[dtype]:
            raise Malformed(f"tensor {name[:40]!r}: its byte range does not match its shape")
        spans.append((begin, end))
    spans.sort()
    at = 0
    for begin, end in spans:
        if begin != at:
            raise Malformed("tensor byte ranges overlap or leave gaps")
        at = end
    if at != data_bytes:
        raise Malformed("bytes after the last tensor")


def check_tree(text: str, tensors: dict) -> None:
    """The structure's schema: JSON primitives, or one-key objects tagged as in `TAGS`."""
    if len(text) > MAX_HEADER:
        raise Malformed("the structure is too large")
    try:
        root = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"the structure is not JSON ({type(exc).__name__})") from None
    stack, nodes = [(root, 0)], 0
    while stack:
        x, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            raise Malformed("the structure is nested too deep or too large")
        t = type(x)
        if x is None or t in (bool, int, float):
            continue
        if t is str:
            if len(x) > MAX_STR:
                raise Malformed("a string longer than 64 KiB")
            continue
        if t is not dict or len(x) != 1:
            raise Malformed("the structure holds something that is not a tagged value")
        ((tag, v),) = x.items()
        if tag not in TAGS:
            raise Malformed(f"the structure holds an unknown tag {tag[:20]!r}")
        if tag in ("list", "tuple"):
            if type(v) is not list:
                raise Malformed(f"a {tag} that is not a list")
            stack += [(y, depth + 1) for y in v]
        elif tag == "dict":
            if type(v) is not list or any(type(kv) is not list or len(kv) != 2 for kv in v):
                raise Malformed("a dict that is not a list of pairs")
            stack += [(y, depth + 1) for kv in v for y in kv]
        elif tag == "tensor":
            if type(v) is not str or v not in tensors:
                raise Malformed("a reference to a tensor that is not there")
        elif tag == "dtype":
            if type(v) is not str or v not in TORCH_DTYPES:
                raise Malformed("an unknown dtype")
        elif tag == "size":
            if type(v) is not list or len(v) > 16 or any(type(d) is not int or d < 0 for d in v):
                raise Malformed("a bad size")
        elif tag == "region":
            if type(v) is not int:
                raise Malformed("a bad traffic reference")
        elif tag == "record":
            if type(v) is not list or len(v) != 2 or type(v[0]) is not str or v[0] not in RECORDS or type(v[1]) is not list \
                    or len(v[1]) != len(RECORDS[v[0]]) or any(type(f) is not int for f in v[1]):
                raise Malformed("a bad measurement record")


def problem(blob: bytes) -> str:
    """'' when `blob` respects every bound; else why not (one line)."""
    try:
        entries, meta, start = split(blob)
        _check_tensors(entries, len(blob) - start)
        check_tree(meta["distlab"], entries)
    except Malformed as exc:
        return str(exc)
    except MemoryError:
        return "its parsing ran out of memory"
    return ""


# ---- the child process ------------------------------------------------------------------------------

CHILD_MEMORY = 3 << 30


def frame(blobs: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(b)) + b for b in blobs)


def unframe(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos + 8 <= len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        out.append(data[pos + 8: pos + 8 + n])
        pos += 8 + n
    return out


def _child_limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def deadline_for(total_bytes: int) -> float:
    """Seconds the child may take: far more than a linear pass over the bytes needs, even on a busy machine."""
    return 20.0 + total_bytes / (1 << 20)


def check_in_child(blobs: list[bytes], deadline_s: float | None = None) -> list[str]:
    """`problem` of each blob, computed in a child process with a deadline and a memory limit; if the child
    does not answer in time (or dies), every blob gets that as its problem."""
    data = frame(blobs)
    deadline_s = deadline_for(len(data)) if deadline_s is None else deadline_s
    try:
        run = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__)], input=data,
                             capture_output=True, timeout=deadline_s, preexec_fn=_child_limits)
        got = json.loads(run.stdout.decode()) if run.returncode == 0 else None
    except subprocess.TimeoutExpired:
        return [f"its outputs could not be checked within {deadline_s:g} s"] * len(blobs)
    except (ValueError, OSError):
        got = None
    if type(got) is not list or len(got) != len(blobs) or any(type(g) is not str for g in got):
        return ["its outputs could not be checked (the checking process failed)"] * len(blobs)
    return got


if __name__ == "__main__":
    print(json.dumps([problem(b) for b in unframe(sys.stdin.buffer.read())]))
