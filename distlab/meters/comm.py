"""Per-rank communication: calls and bytes sent, per collective kind.

`track_comm()` is a `TorchDispatchMode`: every collective reaches the
dispatcher as a `c10d.*` op, whether the learner called `dist.all_reduce`,
PyTorch's DDP reducer bucketed it in C++, `ZeroRedundancyOptimizer`
broadcast a shard, or FSDP2 gathered a unit. So one meter counts all of them.

Bytes are what this rank sends under the bandwidth-optimal (ring) algorithm
for that collective, with S the size of the whole message (as nccl-tests
defines it): all-reduce 2(N-1)/N x S, all-gather and reduce-scatter
(N-1)/N x S, all-to-all what leaves for the other ranks, broadcast and
reduce S, send S, recv 0. See `distlab.theory.collective_bytes_sent`.

What it cannot see: traffic a library does not route through the
dispatcher (e.g. the TCPStore rendezvous), and on which wire bytes went
(NVLink, PCIe, InfiniBand, loopback).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from distlab.meters.dispatch import EagerMode
from distlab.theory import collective_bytes_sent

# c10d op name -> (collective kind, how to find S: "in", "out", "in_all", ...)
_C10D_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "reduce_": "reduce",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "gather_": "gather", "scatter_": "scatter", "barrier": "barrier",
}
_FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CommStats:
    """A picklable snapshot of one rank's traffic."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def _group(args: tuple) -> tuple[int, int]:
    """(size, rank) of the process group among a c10d op's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except Exception:  # noqa: BLE001 - a ReduceOp or Work, not a group
                continue
            return pg.size(), pg.rank()
    return dist.get_world_size(), dist.get_rank()


def _a2a_single_sent(inp: torch.Tensor, in_split: list[int], n: int, me: int) -> int:
    """`all_to_all_single`: the input's rows but this rank's own split (even splits when none are given)."""
    row = inp[0].numel() * inp.element_size() if inp.dim() and len(inp) else 0
    return _nbytes(inp) - (in_split[me] * row if in_split else _nbytes(inp) // n)


def _sent_bytes(op: str, kind: str, args: tuple, n: int, me: int) -> int:
    """Bytes this rank sends for one c10d op (S as nccl-tests defines it)."""
    if kind in ("all_reduce", "broadcast", "reduce", "send"):
        return collective_bytes_sent(kind, _nbytes(args[0]), n)
    if kind == "all_gather":  # (outputs, inputs, ...): S = N x input
        return collective_bytes_sent(kind, n * _nbytes(args[1]), n)
    if kind == "reduce_scatter":  # (outputs, inputs, ...): S = N x output
        return collective_bytes_sent(kind, n * _nbytes(args[0]), n)
    if kind == "all_to_all":  # exactly what leaves this rank for the others
        if op == "alltoall_":
            inputs = list(args[1])
            return _nbytes(inputs) - _nbytes(inputs[me])
        return _a2a_single_sent(args[1], list(args[4]) if len(args) > 4 else [], n, me)
    if kind == "gather":  # non-roots send their input to the root
        return _nbytes(args[1]) if me != args[3] else 0
    if kind == "scatter":  # the root sends N-1 outputs
        return (n - 1) * _nbytes(args[0]) if me == args[3] else 0
    return 0  # recv, barrier


def _own_dispatch(t: type) -> bool:
    """A DTensor: it turns an op into local ops and collectives of its own."""
    from torch.distributed.tensor import DTensor
    return isinstance(t, type) and issubclass(t, DTensor)


class _CommMeter(EagerMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(_own_dispatch(t) for t in types):
            # A tensor subclass (DTensor) runs first: the collectives it issues inside the op
            # (an implicit redistribute) then reach this mode, as in torch's CommDebugMode.
            return NotImplemented
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "c10d" and name in _C10D_KINDS:
            kind = _C10D_KINDS[name]
            n, me = _group(args)
            self._add(kind, _sent_bytes(name, kind, args, n, me))
        elif ns == "_c10d_functional" and name in _FUNCTIONAL_KINDS:
            kind = _FUNCTIONAL_KINDS[name]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            n = group.size()
            if kind == "all_to_all":   # (input, output_split_sizes, input_split_sizes, group): splits may be uneven
                self._add(kind, _a2a_single_sent(args[0], list(args[2] or []), n, group.rank()))
            else:
                whole = _nbytes(args[0]) * (n if kind == "all_gather" else 1)
                self._add(kind, collective_bytes_sent(kind, whole, n))
        return func(*args, **kwargs)

    def _add(self, kind: str, sent: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += sent

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def stats(self) -> CommStats:
        return CommStats(dict(self.calls), {k: self.bytes.get(k, 0) for k in self.calls})


@contextmanager
def track_comm() -> Iterator[_CommMeter]:
    """Count collectives issued inside the block on this rank.

    The meter exposes `.calls` and `.bytes` (dicts keyed by collective kind:
    'all_reduce', 'all_gather', 'reduce_scatter', 'broadcast', 'reduce',
    'all_to_all', 'send', 'recv', ...), `.total_bytes`, and `.stats()` for a
    picklable snapshot. The Python dispatch mode costs a little per op:
    count bytes in one step and time other steps.
    """
    with _CommMeter() as meter:
        yield meter
