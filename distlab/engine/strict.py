"""NCCL's semantics on CPU ranks, one rule at a time (the strict backend grows here).

First rule, one Work per coalesced p2p group: on NCCL, `dist.batch_isend_irecv(ops)` returns a
list holding ONE Work for the whole group, while gloo returns one Work per op. Code that pairs
the returned Works with its ops (`zip(recv_parts, works)`) is right on gloo and silently wrong on
NCCL: it waits for, and uses, only the first. Inside `one_work_per_p2p_group()` a gloo rank gets
NCCL's answer: one Work whose `wait()` waits for every op of the group.

    with one_work_per_p2p_group():
        works = dist.batch_isend_irecv(ops)      # len(works) == 1, as on NCCL
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist


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
    """`dist.batch_isend_irecv` returns [GroupWork(all of the group's Works)] while this is active."""
    original = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        works = original(p2p_op_list)
        return [GroupWork(list(works))] if works else works

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = original
