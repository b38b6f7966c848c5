"""Lab 7's context-parallel tasks (`distlab.checks.ch07` lists them): zig-zag ring attention, and Ulysses'
all-to-alls between the sequence layout and the head layout.

Both run the learner's functions on 2 and 4 real ranks on random (B, a, S, hd) queries, keys and values (the
same numbers on every rank and here) and judge, against causal attention computed in one process here:

- zig-zag: the output of rank r's two blocks (r and 2cp-1-r of 2cp), what it sends (K and V around the
  ring: 2(cp-1)/cp x B S h e, `ring_attention_bytes`) and its attention FLOPs, counted by PyTorch's
  `FlopCounterMode`: the same on every rank, 2cp+1 block pairs (a plain ring computes 1 on rank 0 and cp on
  rank cp-1);
- ulysses: each layout change (sequence -> heads and back) and the attention between them, and the traffic:
  four all-to-alls, 4(cp-1)/cp^2 x B S h e (`ulysses_bytes`).
"""
from __future__ import annotations

from typing import Any

import torch

import distlab
from distlab.checks.ch07_common import E, expect_traffic, randn, same, values_line
from distlab.checks.task import Case, Line, check_line
from distlab.checks.verdict import CheckFailed, expect
from distlab.course.tensor_parallel.model import attention_core
from distlab.meters import track_comm

CP_B, CP_HEADS, CP_SEQ, CP_HD = 2, 8, 32, 8      # S splits into 2cp blocks for cp = 2 and 4; heads into cp groups
QKV_SEEDS = (40, 41, 42)


def _qkv() -> list[torch.Tensor]:
    """Q, K and V of the whole sequence in the notebook (seeded); under grading they are drawn (`_drawn`)."""
    return [randn(CP_B, CP_HEADS, CP_SEQ, CP_HD, seed=s) for s in QKV_SEEDS]


def _drawn(rng: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(CP_B, CP_HEADS, CP_SEQ, CP_HD, generator=rng) for _ in QKV_SEEDS]


def _given(inputs: dict | None, r: int, cp: int, part: Any) -> list[torch.Tensor]:
    """Rank r's part of Q, K and V: `part(z, r, cp)` of the seeded ones, or the drawn ones it received."""
    return [part(z, r, cp) for z in _qkv()] if inputs is None else [inputs[k] for k in "qkv"]


def _ulysses_part(x: torch.Tensor, r: int, cp: int) -> torch.Tensor:
    """Rank r's slice of the sequence."""
    return x.chunk(cp, dim=-2)[r].contiguous()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole sequence, one process."""
    s = q.shape[-2]
    return attention_core(q, k, v, torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1))


def zigzag_blocks(x: torch.Tensor, r: int, cp: int) -> torch.Tensor:
    """Rank r's part of a (B, a, S, hd) tensor under the zig-zag layout: blocks r and 2cp-1-r of 2cp, in that
    order along the sequence."""
    parts = x.chunk(2 * cp, dim=-2)
    return torch.cat([parts[r], parts[2 * cp - 1 - r]], dim=-2)


def unzigzag(parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole sequence from every rank's `zigzag_blocks` (in the grader, from the drawn inputs)."""
    cp = len(parts)
    blocks: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        blocks[r], blocks[2 * cp - 1 - r] = part.chunk(2, dim=-2)
    return torch.cat(blocks, dim=-2)


def pair_flops(cp: int) -> int:
    """FLOPs of one block pair: scores (c x hd by hd x c) and probabilities times V, 2 x 2 B a c^2 hd, c = S/2cp."""
    c = CP_SEQ // (2 * cp)
    return 4 * CP_B * CP_HEADS * c * c * CP_HD


def zigzag_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: Q, K and V drawn; each rank receives its own two blocks only."""
    qkv, cp = _drawn(rng), case.world_size
    return [{k: zigzag_blocks(z, r, cp).contiguous() for k, z in zip("qkv", qkv)} for r in range(cp)]


def zigzag_exercise(case: Case, fn: Any, inputs: dict | None = None) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    r, cp, dev = distlab.rank(), distlab.world_size(), distlab.device()
    mine = [z.contiguous().to(dev) for z in _given(inputs, r, cp, zigzag_blocks)]
    distlab.engine.runtime.progress("zig-zag ring attention: one call")
    with track_comm() as comm, FlopCounterMode(display=False) as flops:
        out = fn(*mine)
    return {"out": out.detach().cpu() if isinstance(out, torch.Tensor) else out, "comm": comm.stats(),
            "flops": int(flops.get_total_flops())}


def zigzag_reference(case: Case, inputs: list | None = None) -> dict:
    qkv = _qkv() if inputs is None else [unzigzag([mine[k] for mine in inputs]) for k in "qkv"]
    whole = _attention(*qkv)
    return {r: zigzag_blocks(whole, r, case.world_size) for r in range(case.world_size)}


def zigzag_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    from distlab.theory.tensor_parallel import ring_attention_bytes
    cp = case.world_size

    def values() -> str:
        def check(r: int, out: dict) -> None:
            same(out["out"], ref[r], f"the output of blocks {r} and {2 * cp - 1 - r} (in that order)")
        return values_line(outputs, check)

    def traffic() -> str:
        want = round(ring_attention_bytes(CP_B, CP_SEQ, CP_HEADS * CP_HD, cp, bytes_per_element=E))
        for r, out in enumerate(outputs):
            st = out["comm"]
            other = sorted(set(st.calls) - {"send", "recv"})
            expect(not other, f"rank {r} ran {other}: a ring needs only sends and receives to its neighbours")
            sent = st.bytes.get("send", 0)
            expect(sent == want, f"rank {r} sent {sent} B; K and V of its two blocks, passed on cp-1 = {cp - 1} "
                                 f"times, are {want} B (2(cp-1)/cp x B S h e)")
        return "K and V passed cp-1 times around the ring, 2(cp-1)/cp x B S h e per rank"

    def balance() -> str:
        per = [out["flops"] for out in outputs]
        most = (2 * cp + 1) * pair_flops(cp)
        if len(set(per)) > 1:
            raise CheckFailed(f"attention FLOPs per rank {per}: unbalanced (each rank should compute 2cp+1 = "
                              f"{2 * cp + 1} block pairs: skip every pair whose keys all lie in its queries' future)")
        expect(per[0] <= most, f"each rank computed {per[0]:,} FLOPs, {per[0] / pair_flops(cp):.0f} block pairs; "
                               f"2cp+1 = {2 * cp + 1} suffice (a pair whose keys all lie in the future is skipped)")
        expect(per[0] >= most, f"each rank computed {per[0]:,} FLOPs, fewer than the 2cp+1 = {2 * cp + 1} block "
                               "pairs causal attention needs")
        return f"every rank computed 2cp+1 = {2 * cp + 1} block pairs ({per[0]:,} FLOPs)"

    return [check_line(case.lines[0], values), check_line(case.lines[1], traffic), check_line(case.lines[2], balance)]


def ulysses_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: Q, K and V drawn; each rank receives its own slice of the sequence only."""
    qkv, cp = _drawn(rng), case.world_size
    return [{k: _ulysses_part(z, r, cp) for k, z in zip("qkv", qkv)} for r in range(cp)]


def ulysses_exercise(case: Case, seq_to_heads: Any, heads_to_seq: Any, inputs: dict | None = None) -> dict:
    r, cp, dev = distlab.rank(), distlab.world_size(), distlab.device()
    mine = [z.to(dev) for z in _given(inputs, r, cp, _ulysses_part)]
    distlab.engine.runtime.progress("Ulysses: sequence -> heads, attention, heads -> sequence")
    with track_comm() as comm:
        heads = [seq_to_heads(z) for z in mine]
        y = _attention(*heads) if all(isinstance(h, torch.Tensor) for h in heads) else None
        back = heads_to_seq(y) if y is not None else None
    cpu = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else None  # noqa: E731
    return {"heads": [cpu(h) for h in heads], "out": cpu(back), "comm": comm.stats()}


def ulysses_reference(case: Case, inputs: list | None = None) -> dict:
    cp = case.world_size
    qkv = _qkv() if inputs is None else [torch.cat([mine[k] for mine in inputs], dim=-2) for k in "qkv"]
    whole = _attention(*qkv)
    return {r: {"heads": [z.chunk(cp, dim=1)[r] for z in qkv], "out": whole.chunk(cp, dim=-2)[r]}
            for r in range(cp)}


def ulysses_judge(case: Case, outputs: list, ref: dict) -> list[Line]:
    from distlab.theory.tensor_parallel import ulysses_bytes
    cp = case.world_size

    def layouts() -> str:
        def check(r: int, out: dict) -> None:
            for name, got, want in zip("QKV", out["heads"], ref[r]["heads"]):
                same(got, want, f"seq_to_heads({name}): heads {r * CP_HEADS // cp}..{(r + 1) * CP_HEADS // cp - 1} "
                                f"over the whole sequence, shape (B, a/cp, S, hd) = {tuple(want.shape)}")
        return values_line(outputs, check)

    def attention() -> str:
        return values_line(outputs, lambda r, out: same(
            out["out"], ref[r]["out"], "heads_to_seq(attention): my S/cp tokens, every head"))

    def traffic() -> str:
        size = CP_B * CP_HEADS * CP_SEQ // cp * CP_HD            # one rank's block of Q (or K, V, output)
        one = (1, round((cp - 1) / cp * size * E))
        for r, out in enumerate(outputs):
            expect_traffic(f"rank {r}, Q, K, V there and the output back", out["comm"], {"all_to_all": (4 * one[0], 4 * one[1])})
        total = round(ulysses_bytes(CP_B, CP_SEQ, CP_HEADS * CP_HD, cp, bytes_per_element=E))
        return f"4 all-to-alls, 4(cp-1)/cp^2 x B S h e = {total} B per rank"

    return [check_line(case.lines[0], layouts), check_line(case.lines[1], attention), check_line(case.lines[2], traffic)]
