"""One Work per coalesced p2p group (NCCL's rule, `distlab.engine.strict`), and the ring that broke on it.

On NCCL `batch_isend_irecv` returns one Work for the whole group. Solution 01's reduce-scatter cut
each chunk into ~1 MiB pieces, posted them in one group and paired the Works with the pieces
(`zip(recv_parts, works)`): on NCCL it waited for and added only the first piece once a chunk
reached 2 MiB. The graded checks use at most 1001 elements, so only this size shows it.
Both rings run in one launch of 3 ranks (a module fixture; the launcher's no-orphans check is test_launch's).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.course.collectives import chunk_bounds, combine
from distlab.engine.strict import one_work_per_p2p_group
from labkit import answers

CHUNK = 2 ** 19 + 3          # float32 elements per rank's chunk: just over 2 MiB, so 2 pieces of ~1 MiB


def _zip_works_reduce_scatter(tensor, op=dist.ReduceOp.SUM):
    """The old solution's step loop: right on gloo, wrong where the group has one Work."""
    r, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    scratch = torch.empty_like(chunks[0])
    pieces = max(1, chunks[0].numel() * flat.element_size() // (1 << 20))
    for s in range(n - 1):
        out, into = chunks[(r - s - 1) % n], chunks[(r - s - 2) % n]
        recv_parts = chunk_bounds(into.numel(), pieces)
        ops = [dist.P2POp(dist.irecv, scratch[a:b], (r - 1) % n) for a, b in recv_parts]
        ops += [dist.P2POp(dist.isend, out[a:b], (r + 1) % n) for a, b in chunk_bounds(out.numel(), pieces)]
        works = dist.batch_isend_irecv(ops)
        for (a, b), work in zip(recv_parts, works):
            work.wait()
            combine(op, into[a:b], scratch[a:b])
        for work in works[len(recv_parts):]:
            work.wait()
    return tensor


def _all_reduce_errors(reduce_scatter, all_gather):
    """max |ring all-reduce - dist.all_reduce| with gloo's Works, then with one Work per group (NCCL's)."""
    n, r = distlab.world_size(), distlab.rank()
    out = []
    for strict in (False, True):
        x = torch.randn(n * CHUNK, generator=torch.Generator().manual_seed(r)).to(distlab.device())
        expected = x.clone()
        dist.all_reduce(expected)
        with one_work_per_p2p_group() if strict else contextlib.nullcontext():
            reduce_scatter(x)
            all_gather(x)
        out.append((x - expected).abs().max().item())
    return out


def _group_works():
    n, r = distlab.world_size(), distlab.rank()
    x, y = torch.ones(4, device=distlab.device()) * r, torch.empty(4, device=distlab.device())
    ops = [dist.P2POp(dist.isend, x, (r + 1) % n), dist.P2POp(dist.irecv, y, (r - 1) % n)]
    with one_work_per_p2p_group():
        works = dist.batch_isend_irecv(ops)
        works[0].wait()
    received = y.tolist()                     # the one Work's wait() covered the receive too
    again = dist.batch_isend_irecv(ops)       # outside: gloo's own answer again, one Work per op
    for w in again:
        w.wait()
    return len(works), received, len(again)


def test_one_work_per_group_waits_for_the_whole_group(no_orphans):
    out = distlab.launch(_group_works, 2)
    assert out == [(1, [1.0] * 4, 2), (1, [0.0] * 4, 2)]


def _both_rings(old_reduce_scatter, reduce_scatter, all_gather):
    """`_all_reduce_errors` of the old ring, then of the solution's, in one launch."""
    return _all_reduce_errors(old_reduce_scatter, all_gather), _all_reduce_errors(reduce_scatter, all_gather)


@pytest.fixture(scope="module")
def ring_errors():
    """Per rank, on 3 ranks: (the old ring's errors, the solution ring's), each (gloo's Works, NCCL's rule)."""
    ns = answers("01_collectives")
    return distlab.launch(_both_rings, 3, args=(_zip_works_reduce_scatter, ns.ring_reduce_scatter,
                                                ns.ring_all_gather))


def test_the_old_ring_is_right_on_gloo_and_wrong_under_nccls_rule(ring_errors):
    for (loose, strict), _ in ring_errors:
        assert loose < 1e-4
        assert strict > 0.1          # the second piece of every step was never added


def test_the_solution_ring_is_right_under_nccls_rule(ring_errors):
    for _, errors in ring_errors:
        assert max(errors) < 1e-4, errors
