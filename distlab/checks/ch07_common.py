"""Constants and helpers shared by lab 7's task modules (`ch07`, `ch07_sp`)."""
from __future__ import annotations

from typing import Any

import torch

from distlab.checks.verdict import CheckFailed, compare
from distlab.course.tensor_parallel.model import TP_PRESETS, Block, build_tp_model

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distlab
from distlab.course.tensor_parallel.model import Attention, Block, MLP, Transformer, attention_core"""

CFG = TP_PRESETS["tp-tiny"]            # h = 32, 8 heads, d_ff = 128, S = 16: splits over 2, 4 and 8 ranks
B = 2                                  # rows per batch
E = 4                                  # fp32: bytes per activation element
ATOL, RTOL = 2e-5, 1e-4                # fp32, sums in another order than one process
TRAIN_ATOL, TRAIN_RTOL = 1e-4, 1e-3    # after a few training steps
STEPS = 3                              # training steps compared with one process
COL = ("wq", "wk", "wv", "fc")         # column-parallel: rank r keeps rows (and bias) chunk r
ROW = ("wo", "out")                    # row-parallel: rank r keeps columns chunk r, the whole bias

HANG_HINT = ("Ranks hang when one of them skips a collective the others enter: every rank of the "
             "group must call the same all-reduce (or all-gather / reduce-scatter), with the same size, "
             "in forward and in backward.")


class MomentumSGD:
    """`torch.optim.SGD(params, lr=0.1, momentum=0.9)`'s arithmetic, for the training checks.

    Written out because the first `torch.optim` step imports torch._dynamo (seconds, in the
    notebook's kernel, where the reference runs). And SGD, not AdamW: AdamW turns rounding noise into
    full-size steps on parameters whose true gradient is 0, such as the key bias (softmax ignores it).
    """

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.bufs: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.bufs.get(id(p))
            if buf is None:
                buf = self.bufs[id(p)] = p.grad.detach().clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def make_optimizer(params: Any) -> MomentumSGD:
    return MomentumSGD(params)


def randn(*shape: int, seed: int) -> torch.Tensor:
    """The same numbers on every rank and here (CPU generator)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def block(seed: int = 0) -> Block:
    """The reference block (CPU, fp32); on a rank `.to(distlab.device())`."""
    return build_tp_model(CFG, seed=seed, device="cpu").blocks[0]


def shard_of(name: str, full: torch.Tensor, r: int, t: int) -> torch.Tensor:
    """What rank r of t holds of the parameter (or gradient) called `name` (its last two parts decide)."""
    parts = name.split(".")
    layer, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if layer in COL:
        return full.chunk(t, 0)[r]
    if layer in ROW and kind == "weight":
        return full.chunk(t, 1)[r]
    return full


def comm_of(stats: Any) -> dict[str, tuple[int, int]]:
    """{kind: (calls, bytes)} of a CommStats."""
    return {k: (stats.calls[k], stats.bytes.get(k, 0)) for k in stats.calls}


def expect_traffic(where: str, stats: Any, want: dict[str, tuple[int, int]]) -> None:
    got = comm_of(stats)
    if got != want:
        say = lambda d: ", ".join(f"{n} x{c} ({b} B)" for n, (c, b) in sorted(d.items())) or "nothing"  # noqa: E731
        raise CheckFailed(f"{where}: sent {say(got)}; expected {say(want)}")


def all_reduce_of(numel: int, t: int) -> tuple[int, int]:
    return 1, round(2 * (t - 1) / t * numel * E)


def half_of(numel: int, t: int) -> tuple[int, int]:
    """One all-gather or reduce-scatter of a message of `numel` fp32 elements."""
    return 1, round((t - 1) / t * numel * E)


def values_line(outputs: list, check: Any) -> str:
    for r, out in enumerate(outputs):
        try:
            check(r, out)
        except CheckFailed as exc:
            raise CheckFailed(f"rank {r}: {exc}") from None
    return "every rank matches one process"


def same(mine: Any, want: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    if mine is None:
        raise CheckFailed(f"{what} is missing (None)")
    compare(mine, want, atol=atol, rtol=rtol, what=what)


def metered_pair(op: Any, x: torch.Tensor, grad: torch.Tensor, group: Any, what: str) -> dict[str, Any]:
    """One autograd operator of a pair (f or g, GatherFromSP or ReduceScatterToSP): `op.apply(x, group)`
    forward, then backward with `grad` on its output, each under its own comm meter. Returns its output,
    the input's gradient and what crossed the wire in each pass. `x` goes in as a non-leaf copy, so an
    operator may all-reduce its input in place."""
    import distlab
    from distlab.meters import track_comm
    dev = distlab.device()
    distlab.engine.runtime.progress(f"{what}: forward, then backward")
    leaf = x.to(dev).requires_grad_()
    with track_comm() as fwd:
        y = op.apply(leaf * 1.0, group)
    with track_comm() as bwd:
        y.backward(grad.to(dev))
    return {"out": y.detach().clone(), "grad": leaf.grad, "fwd": fwd.stats(), "bwd": bwd.stats()}

