"""A rank's outputs on their way to the grader: tensors in safetensors, the structure as JSON. No pickle.

    encode(outputs) -> bytes      on the rank (the grader believes nothing of what comes back)
    decode(blob) -> outputs       in the grader, only after `resultcheck` passed the blob in a child

The structure (`__metadata__["distlab"]` of the safetensors header) is JSON
whose values are JSON primitives or one-key objects:

    {"list": [...]}  {"tuple": [...]}  {"dict": [[key, value], ...]}  {"tensor": "t0"}
    {"dtype": "float32"}  {"size": [2, 3]}  {"region": k}  {"record": ["MemoryStats", [current, peak]]}

`{"region": k}` stands where the check had a `CommStats`: the audit hook's
record of traffic region k (see `distlab.grading.evidence.substitute`).
"""
from __future__ import annotations

import json
from typing import Any

from distlab.grading.resultcheck import MAX_DEPTH, RECORDS, Malformed, split

REGION_KEY = "__distlab_region__"


def encode(outputs: Any) -> bytes:
    """`outputs` (what `distlab.checks.task.validate` accepts, CommStats already replaced by
    `{REGION_KEY: k}`) as one safetensors file."""
    import torch
    from safetensors.torch import save

    from distlab.meters.memory import MemoryStats, ModelState
    tensors: dict[str, torch.Tensor] = {}

    def node(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("the outputs are nested too deep")
        t = type(x)
        if x is None or t in (bool, int, str):
            return x
        if t is float:
            return x
        if t is dict and set(x) == {REGION_KEY}:
            return {"region": int(x[REGION_KEY])}
        if t is dict:
            return {"dict": [[node(k, depth + 1), node(v, depth + 1)] for k, v in x.items()]}
        if t in (list, tuple):
            return {t.__name__: [node(v, depth + 1) for v in x]}
        if t is torch.Size:
            return {"size": [int(d) for d in x]}
        if t is torch.dtype:
            return {"dtype": str(x).removeprefix("torch.")}
        if t in (MemoryStats, ModelState):
            return {"record": [t.__name__, [int(getattr(x, f)) for f in RECORDS[t.__name__]]]}
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = x.detach().cpu().contiguous().clone()
            return {"tensor": name}
        raise TypeError(f"a check's outputs hold a {t.__name__}, which a result cannot carry")

    structure = json.dumps(node(outputs, 0), separators=(",", ":"))
    return save(tensors, metadata={"distlab": structure})


def decode(blob: bytes) -> Any:
    """The outputs `encode` wrote. Call only on a blob `resultcheck.problem` passed (bounded work)."""
    import torch
    from safetensors.torch import load

    from distlab.meters.memory import MemoryStats, ModelState
    records = {"MemoryStats": MemoryStats, "ModelState": ModelState}
    _, meta, _ = split(blob)
    tensors = load(bytes(blob))

    def value(x: Any) -> Any:
        if x is None or type(x) in (bool, int, float, str):
            return x
        ((tag, v),) = x.items()
        if tag == "list":
            return [value(y) for y in v]
        if tag == "tuple":
            return tuple(value(y) for y in v)
        if tag == "dict":
            return {value(k): value(y) for k, y in v}
        if tag == "tensor":
            return tensors[v]
        if tag == "dtype":
            return getattr(torch, v)
        if tag == "size":
            return torch.Size(v)
        if tag == "region":
            return {REGION_KEY: v}
        if tag == "record":
            return records[v[0]](*v[1])
        raise Malformed(f"unknown tag {tag!r}")

    return value(json.loads(meta["distlab"]))
