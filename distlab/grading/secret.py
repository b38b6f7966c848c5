"""Inputs the learner cannot predict: each class run draws a lab's inputs from a secret seed, here.

In the notebook a check builds its inputs from the package (lab 01: `ch01.data(rank, numel, dtype)`,
seeded by rank and size), so a rank could rebuild every other rank's inputs and compute a
collective's result without communicating. A task that declares `inputs(case, rng)`
(`distlab.checks.task.Task`) has them drawn here instead: `draw` calls it with a generator seeded
from `secrets`, in the grader's process; the grader computes the case's reference from all ranks'
inputs (`reference(case, inputs=...)`), and each rank receives only its own, as tensors
(safetensors bytes through a FIFO its trusted code opens, unlinks and reads before its process
group is up, so before any learner code runs: `receive`, then `load`), which the task's
`exercise(case, *answers, inputs=mine)` uses. The seed never leaves the grader.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import struct
from typing import Any

MAX_BYTES = 1 << 20        # one rank's inputs for one case: a FIFO's largest buffer (Linux's pipe-max-size)
_F_SETPIPE_SZ = 1031       # fcntl.F_SETPIPE_SZ (Python >= 3.10 names it; Linux's value)


def draw(task: Any, case: Any) -> list[dict[str, Any]] | None:
    """Every rank's inputs for one case from a fresh secret seed (None: the task's inputs are fixed)."""
    import torch
    drawn = task.inputs(case, torch.Generator().manual_seed(secrets.randbits(63)))
    if drawn is None:
        return None
    if len(drawn) != case.world_size or not all(isinstance(d, dict) for d in drawn):
        raise ValueError(f"{task.name}: inputs() must return one dict per rank ({case.world_size})")
    return drawn


def blob(inputs: dict[str, Any]) -> bytes:
    """One rank's inputs as safetensors bytes."""
    from safetensors.torch import save
    return save({k: v.detach().cpu().contiguous() for k, v in inputs.items()})


def load(data: bytes) -> dict[str, Any]:
    """On the rank: its inputs back as tensors."""
    from safetensors.torch import load as _load
    return _load(data)


# ---- delivery: runner -> rank ----------------------------------------------------------------------------

def offer(path: str, data: bytes) -> int:
    """In the runner: a FIFO at `path` holding `data` (length-prefixed) for one reader; returns the fd to close
    once the launch is over (held open so the bytes wait for the rank)."""
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    framed = struct.pack("<Q", len(data)) + data
    try:
        if len(framed) > 60_000:      # a FIFO holds 64 KiB unless asked for more (up to pipe-max-size)
            if len(framed) > MAX_BYTES or fcntl.fcntl(fd, _F_SETPIPE_SZ, MAX_BYTES) < len(framed):
                raise ValueError(f"secret inputs of {len(framed)} bytes: larger than a FIFO's buffer")
        view = memoryview(framed)
        while view:                   # never blocks: the buffer holds it all
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
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
