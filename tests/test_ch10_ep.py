"""Expert parallelism's uneven all-to-all, as the course meters book it: `dist.all_to_all_single` (c10d) and
PyTorch's differentiable functional one (`all_to_all_single_autograd`, which the lecture uses) each book the
rows that leave the rank, forward and backward, on gloo and on the strict backend."""
from __future__ import annotations

import pytest

import distlab
from distlab.engine.launch import run_on_ranks

INS = [[1, 3, 0], [2, 0, 4], [0, 5, 1]]          # INS[i][j]: rows rank i sends to rank j (3 ranks, 4 numbers a row)


def _uneven(functional: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from distlab.meters import track_comm
    r, n, dev = distlab.rank(), distlab.world_size(), distlab.device()
    ins, outs = INS[r], [INS[j][r] for j in range(n)]
    x = (torch.arange(sum(ins) * 4, dtype=torch.float32, device=dev).view(-1, 4) + 100 * r).requires_grad_()
    with track_comm() as fwd:
        if functional:
            y = all_to_all_single_autograd(x, outs, ins, dist.group.WORLD)
        else:
            y = x.new_empty(sum(outs), 4)
            dist.all_to_all_single(y, x.detach(), outs, ins)
    if not functional:
        return y.cpu(), None, fwd.stats(), None
    with track_comm() as bwd:
        (y * (r + 1)).sum().backward()
    return y.detach().cpu(), x.grad.cpu(), fwd.stats(), bwd.stats()


@pytest.mark.parametrize("functional,strict", [(False, False), (True, False), (True, True)])
def test_uneven_all_to_all_books_the_rows_that_leave(functional, strict):
    out = run_on_ranks(_uneven, 3, args=(functional,), strict=strict)
    for r, (y, grad, fwd, bwd) in enumerate(out):
        sent = sum(c for j, c in enumerate(INS[r]) if j != r) * 16
        assert fwd.calls == {"all_to_all": 1} and fwd.bytes == {"all_to_all": sent}
        # from each source j in rank order, j's rows addressed to r (their first number: 100 j + 4 x row index)
        rows = [100.0 * j + 4 * (sum(INS[j][:r]) + i) for j in range(3) for i in range(INS[j][r])]
        assert y[:, 0].tolist() == rows
        if functional:
            back = sum(INS[j][r] for j in range(3) if j != r) * 16       # the gradients of what it received
            assert bwd.bytes == {"all_to_all": back}
            # each row's gradient is the receiving rank's factor: rows sent to rank j come back as j + 1
            want = [float(j + 1) for j in range(3) for _ in range(INS[r][j])]
            assert grad[:, 0].tolist() == want
