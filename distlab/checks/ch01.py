"""Lab 1's graded tasks: ring reduce-scatter, all-gather, all-reduce, and a naive all-reduce.

Each task runs the learner's function on 2, 3 and 4 ranks, for sizes N does
not divide (1, 7 and 1001 elements: 1 leaves chunks empty), four dtypes and
the SUM and MAX reductions, each call under the traffic meter, so values and
traffic come from the same calls. Two verdict lines per world size:

- values: every rank's result equals the reduction of what every rank
  started with. The expected result is computed here, from the same inputs,
  not on the ranks (in the notebook the inputs are seeded by the package;
  `distlab grade` draws them from a secret seed, `inputs`, and each rank
  receives only its own);
- traffic: only send/recv, and in every call exactly the bytes the algorithm
  needs for that call's chunks (`expected_sent`): (N-1)/N x S for even chunks.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.task import Case, Line, Row, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import CheckFailed, compare
from distlab.course.collectives import chunk_bounds
from distlab.meters import track_comm

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist

import distlab
from distlab.course.collectives import chunk_bounds, combine"""

# What this lab's ranks import. `distlab grade` preloads exactly these before it forks a submission's ranks;
# without this line it preloads `distlab.launch`'s list for every lab, whose torch._dynamo, FSDP, DTensor,
# pipelining and ZeroRedundancyOptimizer cost ~4 s of CPU per graded submission and no ring uses them.
RANK_IMPORTS = ("torch", "torch.distributed", "cloudpickle", "distlab.engine.runtime", "distlab.meters", "distlab.checks",
                "distlab.course.collectives")

WORLD_SIZES = (2, 3, 4)
SIZES = (1, 7, 1001)          # no N in 2..4 divides 7 or 1001; 1 element leaves chunks empty
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _draw(numel: int, g: torch.Generator) -> torch.Tensor:
    # small integers, so every summation order gives the same bits in every dtype
    return torch.randint(-50, 50, (numel,), generator=g)


def data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank `rank` starts with in the notebook (CPU): seeded by rank and size."""
    return _draw(numel, torch.Generator().manual_seed(1000 * rank + numel)).to(dtype)


def _start(rank: int, numel: int, dtype: torch.dtype, inputs: Any) -> torch.Tensor:
    """Rank `rank`'s input: drawn by the grader (`inputs`: that rank's dict), else the notebook's `data`."""
    return data(rank, numel, dtype) if inputs is None else inputs[str(numel)].to(dtype)


def _sizes(numel: int, n: int) -> list[int]:
    return [b - a for a, b in chunk_bounds(numel, n)]


# Bytes rank r sends in one call on `numel` elements of `itemsize` bytes: the algorithm's, whatever the ring's
# direction. Reduce-scatter: every chunk but its own (chunk r ends on rank r); all-gather: every chunk but the
# one it receives last (r+1 or r-1 by direction); all-reduce: both; naive: N-1 whole tensors from rank 0.
def _rs_sent(numel: int, n: int, r: int) -> set[int]:
    return {numel - _sizes(numel, n)[r]}


def _ag_sent(numel: int, n: int, r: int) -> set[int]:
    sizes = _sizes(numel, n)
    return {numel - sizes[(r + 1) % n], numel - sizes[(r - 1) % n]}


def _ar_sent(numel: int, n: int, r: int) -> set[int]:
    sizes = _sizes(numel, n)      # the reduce-scatter may leave any chunk on a rank: every pair of chunks kept
    return {2 * numel - a - b for a in sizes for b in sizes}


def _naive_sent(numel: int, n: int, r: int) -> set[int]:
    return {(n - 1) * numel if r == 0 else numel}


def _label(kind: str, numel: int, dtype: str, op: str) -> str:
    """'7 elements, float32, sum': a case as a learner reads it (an all-gather reduces nothing: no op)."""
    parts = [f"{numel} element{'s' if numel != 1 else ''}", dtype.replace("torch.", "")]
    return ", ".join(parts + ([] if kind == "all_gather" else [op]))


def _cases(kind: str) -> list[tuple[int, torch.dtype, str]]:
    ops = ("sum",) if kind == "all_gather" else tuple(OPS)
    return [(numel, dtype, op) for numel in SIZES for dtype in DTYPES for op in ops]


RING_HANG_HINT = ("A ring hangs when a receive has no matching send: at step s, rank r must receive "
                  "from rank r-1 exactly the chunk (and size) rank r-1 sends at that same step.")


def ring_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's starting values, one tensor per size (cast to each dtype on the rank)."""
    return [{str(numel): _draw(numel, rng) for numel in SIZES} for _ in range(case.world_size)]


def ring_exercise(kind: str, case: Case, fn: Any, inputs: dict | None = None) -> dict:
    """On every rank, with the learner's function: its result and its traffic, for every size, dtype and op."""
    r, n, dev = distlab.rank(), distlab.world_size(), distlab.device()
    results, comm = {}, {}
    for numel, dtype, op in _cases(kind):
        distlab.engine.runtime.progress(_label(kind, numel, str(dtype), op))
        x = _start(r, numel, dtype, inputs).to(dev)
        if kind == "all_gather":
            a, b = chunk_bounds(numel, n)[r]
            mine = torch.full_like(x, 99)     # only my chunk is valid on entry
            mine[a:b] = x[a:b]
            with track_comm() as meter:
                fn(mine)
        else:
            mine = x.clone()
            with track_comm() as meter:
                fn(mine, OPS[op])
        results[numel, str(dtype), op] = mine
        comm[numel, str(dtype), op] = meter.stats()
    return {"results": results, "comm": comm}


def ring_reference(kind: str, case: Case, inputs: list | None = None) -> dict:
    """Here, without learner code: the collective's result from every rank's start."""
    n, out = case.world_size, {}
    for numel, dtype, op in _cases(kind):
        start = [_start(r, numel, dtype, None if inputs is None else inputs[r]) for r in range(n)]
        if kind == "all_gather":
            out[numel, str(dtype), op] = torch.cat([start[s][a:b] for s, (a, b) in
                                                    enumerate(chunk_bounds(numel, n))])
        else:
            stacked = torch.stack(start)
            out[numel, str(dtype), op] = stacked.sum(0).to(dtype) if op == "sum" else stacked.max(0).values
    return out


def ring_judge(kind: str, expected_sent: Any, words: str, case: Case, outputs: list, reference: dict) -> list[Line]:
    """values: every rank's result (its own chunk for a reduce-scatter); traffic: send/recv only, `expected_sent`."""
    n = case.world_size
    values_line, traffic_line = case.lines

    def values() -> str:
        for r, out in enumerate(outputs):
            for key, want in reference.items():
                mine = out["results"][key]
                if kind == "reduce_scatter":   # only chunk r is defined on rank r
                    a, b = chunk_bounds(key[0], n)[r]
                    mine, want = mine[a:b], want[a:b]
                try:
                    compare(mine, want, what="your result")
                except CheckFailed as exc:
                    raise CheckFailed(f"rank {r}, {_label(kind, *key)}: {exc}")
        return f"right on every rank in {len(reference)} cases"

    def traffic() -> str:
        for r, out in enumerate(outputs):
            for key in reference:
                stats = out["comm"][key]
                numel, dtype, op = key
                where = f"rank {r}, {_label(kind, *key)}"
                other = sorted(set(stats.calls) - {"send", "recv"})
                if other:
                    raise CheckFailed(f"rank {r} called {', '.join(other)}: use only send/recv (isend/irecv)")
                itemsize = torch.empty((), dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()
                sent = stats.bytes.get("send", 0)
                want = sorted(e * itemsize for e in expected_sent(numel, n, r))
                if sent not in want:
                    S = numel * itemsize
                    raise CheckFailed(f"{where}: sent {sent} bytes of S={S}; expected "
                                      f"{' or '.join(map(str, want))} ({words}, for chunks of "
                                      f"{_sizes(numel, n)} elements)")
        return f"point-to-point only, sends {words}"

    return [check_line(values_line, values), check_line(traffic_line, traffic)]


def ring(kind: str, answer: str, expected_sent: Any, words: str) -> Row:
    """One ring collective's task (`kind`: reduce_scatter, all_gather, all_reduce or naive_all_reduce): on 2, 3
    and 4 ranks, its values and its traffic (`expected_sent`, said as `words`)."""
    return task(kind, answer, per_ranks(WORLD_SIZES, f"{kind}, {{n}} ranks, values", f"{kind}, {{n}} ranks, traffic"),
                inputs=ring_inputs, exercise=partial(ring_exercise, kind), reference=partial(ring_reference, kind),
                judge=partial(ring_judge, kind, expected_sent, words), hang_hint=RING_HANG_HINT)


TASKS = table(
    ring("reduce_scatter", "ring_reduce_scatter", _rs_sent, "(N-1)/N x S"),
    ring("all_gather", "ring_all_gather", _ag_sent, "(N-1)/N x S"),
    ring("all_reduce", "ring_all_reduce", _ar_sent, "2(N-1)/N x S"),
    ring("naive_all_reduce", "naive_all_reduce", _naive_sent, "(N-1) x S on rank 0, S elsewhere"),
)

grade = grader(TASKS)
