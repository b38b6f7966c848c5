"""Chapter 7, section 5's measurement: context parallelism (ring attention, Ulysses) against one process.

The hand-written attentions are the lesson: they stay in the notebook and come in as arguments,

    cpr = distlab.launch(cp_run, 4, args=({"ring": ring_attention, "ulysses": ulysses_attention}, 2, 8, 1024, 16,
                                          11, 30, RingAttention.apply))

Meters: `track_memory` (peak bytes of a call; bytes kept for backward), `track_comm` (what each rank sends:
the K, V blocks of a ring, the all-to-alls of Ulysses), `distlab.bench.race` for the times. Every tensor a rank
makes is placed on `rt.device()`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from distlab.bench.race import race
from distlab.course.tensor_parallel.model import attention_core
from distlab.engine import runtime as rt
from distlab.meters import track_comm, track_memory


def cp_run(attentions: dict[str, Callable[..., torch.Tensor]], batch: int, heads: int, seq: int, hd: int,
           repeats: int, budget_s: float, train: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """Causal attention over a sequence split in blocks, one per rank, by each of `attentions`
    (name -> fn(q, k, v) on this rank's (B, heads, seq/cp, hd) blocks, returning its output block).

    Returns `one_peak`: peak bytes of one process's attention on the whole sequence (the S x S
    scores); per name: `delta` (largest difference from that), `comm` (`CommStats`: the K, V blocks
    a ring sends, or the all-to-alls of Ulysses) and `peak` bytes; `seconds`: median seconds per
    call of each (`race`, this rank's view of the slowest rank).

    `train`: a differentiable attention fn(q, k, v) (an autograd Function with its own backward ring) run once
    forward and backward on this rank's blocks. Returns under "train": `kept`, the bytes still allocated when
    forward returns (what the step keeps for backward); `fwd` and `bwd`, the `CommStats` of each pass; `dq`,
    `dk`, `dv`, the largest differences of the gradients from one process's; and `one_kept`, the bytes one
    process's attention on the whole sequence keeps (its S x S probabilities).
    """
    r, cp, dev = rt.rank(), rt.world_size(), rt.device()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, hd, generator=g).to(dev) for _ in range(3))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).triu(1)
    with track_memory() as one_mem:
        want = attention_core(q, k, v, causal).chunk(cp, 2)[r]
    mine = [z.chunk(cp, 2)[r].contiguous() for z in (q, k, v)]
    out: dict[str, Any] = {"one_peak": one_mem.peak_bytes}
    for name, fn in attentions.items():
        with track_memory() as mem, track_comm() as comm:
            got = fn(*mine)
        out[name] = dict(delta=(got - want).abs().max().item(), comm=comm.stats(), peak=mem.peak_bytes)
    timing = race({name: (lambda fn=fn: fn(*mine)) for name, fn in attentions.items()},
                  repeats=repeats, budget_s=budget_s)
    out["seconds"] = {name: timing.median(name) for name in attentions}
    if train is not None:
        out["train"] = _cp_train(train, q, k, v, causal, r, cp)
    return out


def _cp_train(train: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: torch.Tensor, r: int, cp: int) -> dict[str, Any]:
    """`cp_run`'s training part: `train` on this rank's blocks against one process on the whole sequence."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device)
    whole = [z.detach().clone().requires_grad_() for z in (q, k, v)]
    with track_memory() as one_mem:
        y = attention_core(*whole, causal)
        one_kept = one_mem.current_bytes
        y.backward(dout)
    mine = [z.detach().chunk(cp, 2)[r].contiguous().requires_grad_() for z in (q, k, v)]
    with track_memory() as mem, track_comm() as fwd:
        got = train(*mine)
        kept = mem.current_bytes
    with track_comm() as bwd:
        got.backward(dout.chunk(cp, 2)[r].contiguous())
    deltas = {f"d{n}": (m.grad - w.grad.chunk(cp, 2)[r]).abs().max().item() for n, m, w in zip("qkv", mine, whole)}
    return dict(kept=kept, one_kept=one_kept, fwd=fwd.stats(), bwd=bwd.stats(),
                delta=(got.detach() - y.detach().chunk(cp, 2)[r]).abs().max().item(), **deltas)
