"""`distlab doctor --run`: what DTensor and `torch.distributed.tensor.parallel` do on this machine's backend.

    from distlab.apps.doctor.dtensor import probe
    for name, (ok, detail) in distlab.launch(probe, 4)[0].items(): ...

Each probe runs one feature chapter 7 relies on, on real ranks, and compares it with
a single-process result; an exception becomes (False, its first line). Most of
PyTorch's tensor parallelism was written for GPUs: this says what this torch build
does on gloo (CPU ranks), so a learner knows before chapter 7. Chapter 7's lecture
shows the layout changes and `context_parallel` itself, in its own cells.
Needs 4 ranks (the 2-D probe uses a 2 x 2 mesh); the 1-D probes use every rank.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.engine import runtime as rt
from distlab.engine.launch import launch
from distlab.meters import track_comm
from distlab.course.tensor_parallel.model import build_tp_model


def _try(fn: Callable[[], str]) -> tuple[bool, str]:
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001 - a failing feature is a finding
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return False, f"{type(exc).__name__}: {first[:160]}"


def _close(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.detach().float() - b.detach().float()).abs().max().item()
    if d > 1e-4:
        raise AssertionError(f"differs from one process by {d:.1e}")
    return f"max |Δ| vs one process {d:.0e}"


def _redistribute() -> str:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    m, n = rt.mesh(), rt.world_size()
    full = torch.arange(8.0 * n, device=rt.device()).view(2 * n, 4)
    kinds = []
    for src, dst in (((Shard(0),), (Replicate(),)), ((Partial(),), (Replicate(),)),
                     ((Partial(),), (Shard(0),)), ((Shard(0),), (Shard(1),))):
        if isinstance(src[0], Partial):   # each rank holds a full-size addend
            dt = DTensor.from_local(full.clone(), m, src)
        else:
            dt = distribute_tensor(full, m, (Replicate(),)).redistribute(m, src)
        with track_comm() as meter:
            moved = dt.redistribute(m, dst)
        want = full * (n if isinstance(src[0], Partial) else 1)
        _close(moved.full_tensor(), want)
        kinds.append(f"{type(src[0]).__name__}->{type(dst[0]).__name__} {'+'.join(meter.calls) or 'no comm'}")
    return "; ".join(kinds)


def _plan(sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan: dict[str, Any] = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                            "attn.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                            "mlp.fc": ColwiseParallel(),
                            "mlp.out": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    # One Replicate DTensor at the module's input: Q, K and V's input gradients add up (Partial)
    # before a single all-reduce, as Megatron's f does. (Under SP: one all-gather of the sequence.)
    gather = PrepareModuleInput(input_layouts=(Shard(1) if sp else Replicate(),), desired_input_layouts=(Replicate(),))
    plan.update({"attn": gather, "mlp": gather})
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


def _tp_block(sp: bool) -> str:
    from torch.distributed.tensor.parallel import parallelize_module
    ref = build_tp_model("tp-tiny", seed=1).blocks[0]
    model = build_tp_model("tp-tiny", seed=1).blocks[0]
    m = rt.mesh()
    parallelize_module(model, m, _plan(sp))
    x = torch.randn(2, 16, 32, device=rt.device(), generator=None)
    dist.broadcast(x, 0)
    ref_out = ref(x)
    r, t = rt.rank(), rt.world_size()
    xin = x.chunk(t, dim=1)[r] if sp else x         # SP: each rank holds its slice of the sequence
    with track_comm() as meter:
        out = model(xin)
        out.sum().backward()
    full = ref_out.chunk(t, dim=1)[r] if sp else ref_out
    ref_out.sum().backward()
    _close(out, full)
    _close(model.attn.wq.weight.grad.full_tensor(), ref.attn.wq.weight.grad)
    ln_grad = model.ln1.weight.grad
    ln_grad = ln_grad.full_tensor() if hasattr(ln_grad, "full_tensor") else ln_grad
    _close(ln_grad, ref.ln1.weight.grad)
    return "grads match; " + ", ".join(f"{k} x{v}" for k, v in meter.calls.items())


def _loss_parallel() -> str:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    ref = build_tp_model("tp-tiny", seed=2)
    model = build_tp_model("tp-tiny", seed=2)
    parallelize_module(model, rt.mesh(), {"head": ColwiseParallel(output_layouts=Shard(-1),
                                                                        use_local_output=False)})
    idx = torch.randint(0, 64, (2, 16), device=rt.device())
    dist.broadcast(idx, 0)
    y = idx.roll(-1, 1)
    want = F.cross_entropy(ref(idx).flatten(0, 1), y.flatten())
    with loss_parallel(), track_comm() as meter:
        loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten())
        loss.backward()
    return _close(loss.full_tensor(), want) + "; " + ", ".join(f"{k} x{v}" for k, v in meter.calls.items())


def _fsdp_tp_2d() -> str:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    if rt.world_size() != 4:
        raise RuntimeError("needs 4 ranks")
    mesh = rt.mesh(2, 2, names=("dp", "tp"))
    ref = build_tp_model("tp-tiny", seed=3)
    model = build_tp_model("tp-tiny", seed=3)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _plan(False))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    idx = torch.randint(0, 64, (4, 16), device=rt.device())
    dist.broadcast(idx, 0)
    dp = mesh["dp"].get_local_rank()
    mine = idx[2 * dp:2 * dp + 2]
    with track_comm() as meter:
        F.cross_entropy(model(mine).flatten(0, 1), mine.roll(-1, 1).flatten()).backward()
    F.cross_entropy(ref(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    g = model.blocks[0].mlp.fc.weight.grad.full_tensor()
    return _close(g, ref.blocks[0].mlp.fc.weight.grad) + "; " + ", ".join(
        f"{k} x{v}" for k, v in meter.calls.items())


def _bf16_all_reduce() -> str:
    x = torch.ones(8, dtype=torch.bfloat16, device=rt.device())
    dist.all_reduce(x)
    _close(x, torch.full_like(x, rt.world_size()))
    return "exact"


def _context_parallel() -> str:
    from torch.distributed.tensor.experimental import context_parallel
    m, n = rt.mesh(), rt.world_size()
    q = torch.randn(1, 2, 8 * n, 8, device=rt.device())
    dist.broadcast(q, 0)
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    qs = q.clone()
    with context_parallel(m, buffers=[qs], buffer_seq_dims=[2]):
        out = F.scaled_dot_product_attention(qs, qs, qs, is_causal=True)
    r = rt.rank()
    return _close(out, want.chunk(n, 2)[r])


PROBES: dict[str, Callable[[], str]] = {
    "DTensor redistribute (all-gather, all-reduce, reduce-scatter, all-to-all)": _redistribute,
    "parallelize_module: ColwiseParallel + RowwiseParallel (a block)": lambda: _tp_block(False),
    "SequenceParallel + PrepareModuleInput (a block)": lambda: _tp_block(True),
    "loss_parallel (vocab-sharded cross-entropy)": _loss_parallel,
    "FSDP2 x TP on a 2 x 2 mesh": _fsdp_tp_2d,
    "bf16 all-reduce": _bf16_all_reduce,
    "context_parallel (causal attention inside SDPA)": _context_parallel,
}


def probe() -> dict[str, tuple[bool, str]]:
    """On every rank: each feature's (works?, detail). Rank 0's answer is the table."""
    import logging
    # DTensor warns (once per rank) where it falls back on CPU: the table says it instead.
    for name in ("torch.distributed.tensor._collective_utils", "torch.distributed.tensor._redistribute"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = {}
    for name, fn in PROBES.items():
        rt.progress(f"probe: {name}")
        out[name] = _try(fn)
        dist.barrier()
    return out


if __name__ == "__main__":
    for name, (ok, detail) in launch(probe, 4)[0].items():
        print(f"{'works' if ok else 'FAILS'}  {name}: {detail}")
