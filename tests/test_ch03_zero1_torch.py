"""Chapter 3's claims about PyTorch's ZeroRedundancyOptimizer, on real ranks (no lab answer involved).

With DDP + ZeroRedundancyOptimizer(MixedPrecisionAdam) every rank keeps about 1/N of the 12 B/param
optimizer state, and one step sends DDP's full all-reduce plus about Psi*b of broadcasts per rank.
"""
from __future__ import annotations

import torch

import distlab
from distlab.meters import model_state, track_comm
from distlab.course.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.theory import comm_bytes_per_rank


def _zero1_torch_step(steps: int):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_model("tiny").to(torch.bfloat16)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=MixedPrecisionAdam, lr=1e-3)
    for step in range(steps):
        x, y = split_batch(synthetic_batch(step, 8, PRESETS["tiny"]), distlab.rank(), distlab.world_size())
        with track_comm() as comm:
            lm_loss(ddp, x, y).backward()
            opt.step()
        state = model_state(model, optimizer=opt.optim)  # step boundary: gradients still alive
        opt.zero_grad(set_to_none=True)
    return state, comm.stats()


def test_zero_redundancy_optimizer_shards_state_but_broadcasts():
    n, psi = 2, num_params(build_model("tiny"))
    out = distlab.launch(_zero1_torch_step, n, args=(2,))
    assert sum(s.optimizer_state for s, _ in out) == 12 * psi  # every parameter's state exactly once
    for state, comm in out:
        assert (state.params, state.grads) == (2 * psi, 2 * psi)  # replicated, as in DDP
        assert comm.bytes["all_reduce"] == comm_bytes_per_rank(psi, n, stage=0, bytes_per_element=2)
        # One broadcast per rank's bucket; each rank is charged the message size: about Psi x 2 B in all.
        assert abs(comm.bytes["broadcast"] - 2 * psi) <= 0.01 * 2 * psi
        assert set(comm.calls) == {"all_reduce", "broadcast"}
