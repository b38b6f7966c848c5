"""What chapter 6 (and 5) state about fully_shard, on real ranks: 16Ψ/N at rest, 3Ψ(N-1)/N per step,
2Ψ(N-1)/N without resharding, and the same parameters as one process."""
from __future__ import annotations

import pytest
import torch

import distlab
from distlab.meters import model_state, track_comm
from distlab.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch
from distlab.theory import comm_bytes_per_rank


def _fsdp_steps(reshard: bool, steps: int = 3):
    from torch.distributed.fsdp import fully_shard
    cfg = PRESETS["tiny"]
    model = build_model("tiny")
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        x, y = split_batch(synthetic_batch(step, 8, cfg), distlab.rank(), distlab.world_size())
        with track_comm() as comm:
            lm_loss(model, x, y).backward()
        opt.step()
        state = model_state(model, optimizer=opt)
        opt.zero_grad(set_to_none=True)
    return state, comm.stats(), {k: v.full_tensor() for k, v in model.named_parameters()}


def _single(steps: int = 3):
    model = build_model("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        x, y = synthetic_batch(step, 8, model.config)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


@pytest.mark.parametrize("reshard, stage", [(True, 3), (False, 2)])
def test_fully_shard_traffic_memory_and_values(reshard, stage):
    psi = num_params(build_model("tiny"))
    ref = _single()
    for state, comm, params in distlab.launch(_fsdp_steps, 2, reshard):
        assert set(comm.calls) == {"all_gather", "reduce_scatter"}
        assert comm.total_bytes == pytest.approx(comm_bytes_per_rank(psi, 2, stage, 4), rel=0.02)
        # At rest: fp32 param + grad + momentum shards, 12 B per parameter / N (dim-0 padding aside).
        assert state.total == pytest.approx(12 * psi / 2, rel=0.02)
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v.detach(), atol=1e-5, rtol=1e-4)
