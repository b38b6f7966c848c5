"""Lab 1's graded tasks: ring reduce-scatter, all-gather, all-reduce, and a naive all-reduce.

Each task runs the learner's function on 2, 3 and 4 ranks, for sizes N does
not divide (1, 7 and 1001 elements: 1 leaves chunks empty), four dtypes and
the SUM and MAX reductions, and once more under the traffic meter on a
message of S = 4096 N bytes. Two verdict lines per world size:

- values: every rank's result equals the reduction of what every rank
  started with. The expected result is computed here, from the same seeded
  inputs, not on the ranks;
- traffic: only send/recv, and exactly the bytes the algorithm needs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import distlab
from distlab.checks.task import Case, Line, Task, grader, judged
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
METERED = 1024                # elements per rank in the metered call: S = 4 * 1024 * N bytes


def data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank `rank` starts with (CPU): small integers, so every summation order gives the same bits."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _cases(kind: str) -> list[tuple[int, torch.dtype, str]]:
    ops = ("sum",) if kind == "all_gather" else tuple(OPS)
    return [(numel, dtype, op) for numel in SIZES for dtype in DTYPES for op in ops]


class RingTask(Task):
    """One ring collective: `kind` is reduce_scatter, all_gather, all_reduce or naive_all_reduce."""

    hang_hint = ("A ring hangs when a receive has no matching send: at step s, rank r must receive "
                 "from rank r-1 exactly the chunk (and size) rank r-1 sends at that same step.")

    def __init__(self, kind: str, answer: str, expected_sent: Any, words: str) -> None:
        self.name, self.kind, self.answers = kind, kind, (answer,)
        self.expected_sent, self.words = expected_sent, words

    def cases(self) -> list[Case]:
        return [Case(n, (f"{self.kind}, {n} ranks, values", f"{self.kind}, {n} ranks, traffic"))
                for n in WORLD_SIZES]

    # -- on every rank, with the learner's function ------------------------------------------------
    def exercise(self, case: Case, fn: Any) -> dict:
        r, n, dev = distlab.rank(), distlab.world_size(), distlab.device()
        results = {}
        for numel, dtype, op in _cases(self.kind):
            distlab.engine.runtime.progress(f"{numel} elements, {str(dtype).replace('torch.', '')}, {op}")
            x = data(r, numel, dtype).to(dev)
            if self.kind == "all_gather":
                a, b = chunk_bounds(numel, n)[r]
                mine = torch.full_like(x, 99)     # only my chunk is valid on entry
                mine[a:b] = x[a:b]
                fn(mine)
            else:
                mine = x.clone()
                fn(mine, OPS[op])
            results[numel, str(dtype), op] = mine
        distlab.engine.runtime.progress(f"the metered call ({n * METERED} float32 elements)")
        x = torch.ones(n * METERED, device=dev)
        with track_comm() as meter:
            fn(x) if self.kind == "all_gather" else fn(x, dist.ReduceOp.SUM)
        return {"results": results, "comm": meter.stats()}

    # -- here, without learner code ----------------------------------------------------------------
    def reference(self, case: Case) -> dict:
        n, out = case.world_size, {}
        for numel, dtype, op in _cases(self.kind):
            inputs = [data(r, numel, dtype) for r in range(n)]
            if self.kind == "all_gather":
                out[numel, str(dtype), op] = torch.cat([inputs[s][a:b] for s, (a, b) in
                                                        enumerate(chunk_bounds(numel, n))])
            else:
                stacked = torch.stack(inputs)
                out[numel, str(dtype), op] = stacked.sum(0).to(dtype) if op == "sum" else stacked.max(0).values
        return out

    def judge(self, case: Case, outputs: list, reference: dict) -> list[Line]:
        n = case.world_size
        values_line, traffic_line = case.lines

        def values() -> str:
            for r, out in enumerate(outputs):
                for key, want in reference.items():
                    mine = out["results"][key]
                    if self.kind == "reduce_scatter":   # only chunk r is defined on rank r
                        a, b = chunk_bounds(key[0], n)[r]
                        mine, want = mine[a:b], want[a:b]
                    try:
                        compare(mine, want, what="your result")
                    except CheckFailed as exc:
                        numel, dtype, op = key
                        raise CheckFailed(f"rank {r}, {numel} elements, {dtype.replace('torch.', '')}, {op}: {exc}")
            return f"right on every rank in {len(reference)} cases"

        def traffic() -> str:
            S = 4 * n * METERED
            for r, out in enumerate(outputs):
                stats = out["comm"]
                other = sorted(set(stats.calls) - {"send", "recv"})
                if other:
                    raise CheckFailed(f"rank {r} called {', '.join(other)}: use only send/recv (isend/irecv)")
                sent, want = stats.bytes.get("send", 0), self.expected_sent(S, n, r)
                if sent != want:
                    raise CheckFailed(f"rank {r} sent {sent} bytes of S={S}; expected {want} ({self.words})")
            return f"point-to-point only, sends {self.words}"

        return [judged(values_line, values), judged(traffic_line, traffic)]


TASKS = {t.name: t for t in (
    RingTask("reduce_scatter", "ring_reduce_scatter", lambda S, n, r: (n - 1) * S // n, "(N-1)/N x S"),
    RingTask("all_gather", "ring_all_gather", lambda S, n, r: (n - 1) * S // n, "(N-1)/N x S"),
    RingTask("all_reduce", "ring_all_reduce", lambda S, n, r: 2 * (n - 1) * S // n, "2(N-1)/N x S"),
    RingTask("naive_all_reduce", "naive_all_reduce", lambda S, n, r: (n - 1) * S if r == 0 else S,
             "(N-1) x S on rank 0, S elsewhere"),
)}

grade = grader(TASKS)
