"""Inputs the learner cannot predict: each class run draws a lab's inputs from a secret seed, here.

In the notebook a check's inputs come from the package (lab 01: `ch01.data(rank, numel, dtype)`,
seeded by rank and size), so a rank could rebuild every other rank's inputs and compute a
collective's result without communicating. When grading, `draw(lab)` draws every rank's inputs
from `secrets` in the grader's process; the references are computed from them here
(`patched`), and each rank receives only its own inputs, as tensors (safetensors bytes through a
FIFO its trusted code opens, unlinks and reads before its process group is up, so before any
learner code runs: `receive`, then `install`). The seed never leaves the grader; a rank that asks
for another rank's inputs gets an error.

A lab takes part when `ADAPTERS` names the function its check module builds inputs with
(today lab 01; the other labs' inputs are models and batches built inside their checks, see
issue 28's report for the change they need).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import struct
from typing import Any, Iterator

# lab -> (the check module's input function, the ranks and the (numel, dtype) pairs it is called with)
ADAPTERS = {"01_collectives": "data"}
MAX_RANKS = 4


def supported(lab: str) -> bool:
    return lab in ADAPTERS


def _key(numel: int, dtype: Any) -> str:
    return f"{numel}:{str(dtype).removeprefix('torch.')}"


def draw(lab: str) -> dict[int, dict[str, Any]]:
    """Every rank's inputs, from a fresh secret seed: {rank: {"numel:dtype": tensor}}."""
    import torch

    from distlab.checks import ch01
    g = torch.Generator().manual_seed(secrets.randbits(63))
    out: dict[int, dict[str, Any]] = {}
    for r in range(MAX_RANKS):
        out[r] = {}
        for numel in ch01.SIZES:
            values = torch.randint(-50, 50, (numel,), generator=g)
            for dtype in ch01.DTYPES:
                out[r][_key(numel, dtype)] = values.to(dtype)
    return out


def _lookup(inputs: dict[int, dict[str, Any]], mine: int | None) -> Any:
    from distlab.checks.verdict import CheckFailed

    def data(rank: int, numel: int, dtype: Any) -> Any:
        if mine is not None and rank != mine:
            raise CheckFailed(f"rank {mine} asked for rank {rank}'s inputs: under grading each rank has only its own")
        try:
            return inputs[rank][_key(numel, dtype)].clone()
        except KeyError:
            raise CheckFailed(f"no graded input for rank {rank}, {numel} elements, {dtype}") from None
    return data


@contextlib.contextmanager
def patched(lab: str, inputs: dict[int, dict[str, Any]]) -> Iterator[None]:
    """In the grader: the check module builds its inputs (for every rank) from `inputs` (for references)."""
    from distlab.checks import lab_module
    module, name = lab_module(lab), ADAPTERS[lab]
    original = getattr(module, name)
    setattr(module, name, _lookup(inputs, None))
    try:
        yield
    finally:
        setattr(module, name, original)


def blob(inputs: dict[str, Any]) -> bytes:
    """One rank's inputs as safetensors bytes."""
    from safetensors.torch import save
    return save({k: v.contiguous() for k, v in inputs.items()})


# ---- delivery: runner -> rank ----------------------------------------------------------------------------

def offer(path: str, data: bytes) -> int:
    """In the runner: a FIFO at `path` holding `data` (length-prefixed) for one reader; returns the fd to close
    once the launch is over (held open so the bytes wait for the rank)."""
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    framed = struct.pack("<Q", len(data)) + data
    if len(framed) > 60_000:      # a FIFO holds 64 KiB without a reader; a check's inputs are far smaller
        os.close(fd)
        raise ValueError("secret inputs larger than a FIFO's buffer")
    os.write(fd, framed)
    return fd


def receive(path: str) -> bytes:
    """On the rank, before its group is up: open the FIFO, unlink it (no other rank can open it after), read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        head = b""
        while len(head) < 8:
            head += os.read(fd, 8 - len(head))
        (n,) = struct.unpack("<Q", head)
        data = b""
        while len(data) < n:
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError("the secret inputs ended early")
            data += chunk
        return data
    finally:
        os.close(fd)


def install(lab: str, data: bytes, rank: int) -> None:
    """On the rank: the check module builds this rank's inputs from `data`; another rank's raise."""
    from safetensors.torch import load

    from distlab.checks import lab_module
    setattr(lab_module(lab), ADAPTERS[lab], _lookup({rank: load(data)}, rank))
