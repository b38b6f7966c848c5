"""The process group a graded rank talks through: every collective it runs is counted.

`MeteredGroup` is a `torch.distributed.ProcessGroup` written in Python and
registered as the backend `metered_gloo` (or `metered_nccl`). A graded rank
re-creates its default group with it before any learner code runs, so every
collective and point-to-point call on any group (the default one, and any
`dist.new_group`) reaches one of its methods: `dist.send`, a
`batch_isend_irecv`, DDP's C++ reducer, ZeroRedundancyOptimizer, FSDP2 alike,
and whether or not a `TorchDispatchMode` is active (the learner can pop those).

The group holds no communicator. Each method raises the audit event
`distlab.pg.op` with its arguments; the audit hook of
`distlab.grading.audithook` (which cannot be removed) forwards the call to
the rank's broker (`distlab.grading.broker`), a process of its own that owns
the real gloo group, runs the call and books its bytes (`OP_KINDS`, the same
algorithmic bytes as `distlab.meters.track_comm`). So the rank holds no
communicator to bypass the meter with. On NCCL the hook owns the real group
itself, runs and books the call (detected, not enforced).
"""
from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

_audit = sys.audit

# ProcessGroup method -> the collective kind `track_comm` books it as.
OP_KINDS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_single": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv": "recv", "recv_anysource": "recv",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier", "monitored_barrier": "barrier",
}


def algorithmic_bytes_booker(numel: Any, element_size: Any, dim: Any, size: Any) -> Any:
    """`book(name, args, n, me) -> (kind, bytes)`: what one call sends, as `track_comm` books it.

    Built once, before learner code runs, from the tensor functions given
    (unbound `TensorBase` methods): the returned closure uses nothing a
    learner could rebind later. `args` are the call's arguments as the
    ProcessGroup method received them; S is the whole message as nccl-tests
    defines it (all-gather: N x input; reduce-scatter: N x output).
    """
    kinds, _type, _list, _tuple, _len, _round = dict(OP_KINDS), type, list, tuple, len, round
    mro = type.__dict__["__mro__"].__get__
    import torch
    tensor_base = torch._C.TensorBase

    def nbytes(x: Any) -> int:
        t = _type(x)
        if t is _list or t is _tuple:
            total = 0
            for v in x:
                total += nbytes(v)
            return total
        return numel(x) * element_size(x) if tensor_base in mro(t) else 0

    def sent(kind: str, s: int, n: int) -> int:
        if n == 1 or kind in ("recv", "barrier"):
            return s if kind == "send" else 0
        if kind == "all_reduce":
            return _round(s * (2 * (n - 1) / n))
        if kind in ("all_gather", "reduce_scatter"):
            return _round(s * ((n - 1) / n))
        return _round(s * 1.0)

    def book(name: str, args: tuple, n: int, me: int) -> tuple[str, int]:
        kind = kinds[name]
        if kind in ("all_reduce", "broadcast", "reduce", "send"):
            return kind, sent(kind, nbytes(args[0]), n)
        if kind == "all_gather":
            return kind, sent(kind, n * nbytes(args[1]), n)
        if kind == "reduce_scatter":
            return kind, sent(kind, n * nbytes(args[0]), n)
        if kind == "all_to_all":
            inp = args[1]
            if name == "alltoall":
                return kind, nbytes(inp) - nbytes(inp[me])
            whole, splits = nbytes(inp), (args[3] if _len(args) > 3 else [])
            if splits and _type(inp) is not _list:
                rows = size(inp, 0) if dim(inp) else 0
                return kind, whole - splits[me] * (whole // rows if rows else 0)
            return kind, whole - whole // n
        if kind == "gather":
            return kind, nbytes(args[1]) if me != args[2].rootRank else 0
        if kind == "scatter":
            return kind, (n - 1) * nbytes(args[0]) if me == args[2].rootRank else 0
        return kind, 0

    return book


class Failed:
    """What the audit hook hands back for a call that failed, instead of raising: an exception leaving the
    hook would carry its frames. The caller raises `exception()`, a fresh one, from its own frame."""

    __slots__ = ("kind", "message")

    def __init__(self, kind: type, message: str) -> None:
        self.kind, self.message = kind, message

    def exception(self) -> BaseException:
        return self.kind(self.message)


def unbox(box: list, what: str) -> Any:
    """What the audit hook put in `box` for a call it ran: the value, or its failure raised here."""
    if not box:
        raise RuntimeError(f"distlab grade: {what} did not run (the grader's audit hook is missing, or the call "
                           "was not distlab's)")
    if type(box[0]) is Failed:
        raise box[0].exception()
    return box[0]


class MeteredGroup(dist.ProcessGroup):
    """A process group whose every call is run (and booked) by the grader's audit hook."""

    def __init__(self, rank: int, size: int, backend_name: str) -> None:
        super().__init__(rank, size)
        self._backend_name = backend_name
        self._group_name = ""
        self._group_desc = ""

    def _op(self, name: str, args: tuple) -> Any:
        box: list = []
        _audit("distlab.pg.op", self, name, box, args)
        return unbox(box, f"the call {name}")

    # -- names torch reads ------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return self._backend_name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc


# Not collectives: NCCL's group markers. Run on the real group, booked as nothing.
COALESCING = ("_start_coalescing", "_end_coalescing")


def _method(name: str) -> Any:
    def op(self: MeteredGroup, *args: Any, **kwargs: Any) -> Any:
        # torch passes some by keyword (`dist.barrier`: `group.barrier(opts=opts)`); the bindings take them in order
        return self._op(name, args + tuple(kwargs.values()))
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"`{name}` on the real group, booked as {OP_KINDS[name]!r}." if name in OP_KINDS else
                  f"NCCL's `{name}` on the real group (a group marker, no bytes).")
    return op


for _name in (*OP_KINDS, *COALESCING):
    setattr(MeteredGroup, _name, _method(_name))


def grouped_batch_isend_irecv(original: Any) -> Any:
    """`dist.batch_isend_irecv` for a metered NCCL group. torch groups p2p ops only on a C++ ProcessGroup
    (`type(group) is ProcessGroup`): on this Python one it would issue them one by one, and on NCCL a ring
    whose ranks each receive then send, ungrouped, deadlocks. Here the ops run between the real group's
    start and end of coalescing, and one Work comes back, as on NCCL without the grader."""
    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        group = p2p_op_list[0].group if p2p_op_list else None
        group = group if group is not None else dist.group.WORLD
        if not (isinstance(group, MeteredGroup) and group._backend_name.endswith("nccl")):
            return original(p2p_op_list)
        dist.distributed_c10d._check_p2p_op_list(p2p_op_list)
        device = p2p_op_list[0].tensor.device
        group._start_coalescing(device)
        for op in p2p_op_list:
            peer = {"group_dst" if op.op is dist.isend else "group_src": op.group_peer}
            op.op(op.tensor, group=op.group, tag=op.tag, **peer)
        return [group._end_coalescing(device)]
    return batch_isend_irecv


def create(opts: Any, backend_options: Any = None, *, backend_name: str) -> MeteredGroup:
    """The backend creator `dist.Backend.register_backend` calls (extended API)."""
    group = MeteredGroup(opts.group_rank, opts.group_size, backend_name)
    box: list = []
    _audit("distlab.pg.create", group, opts.store, opts.group_rank, opts.group_size, opts.timeout,
           list(opts.global_ranks_in_group), str(getattr(opts, "group_id", "")), box)
    unbox(box, "creating the process group")
    return group
