"""Chapter 2 on real ranks: DDP + MixedPrecisionAdam keeps ranks equal, holds 16 B/param, sends 2Ψ(N-1)/N."""
from __future__ import annotations

import torch

import distlab
from distlab.meters import model_state, track_comm
from distlab.course.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.theory import comm_bytes_per_rank


def _mixed_ddp_steps(steps: int):
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = PRESETS["tiny"]
    model = build_model("tiny", seed=distlab.rank()).to(torch.bfloat16)  # ranks start different
    ddp = DDP(model, gradient_as_bucket_view=True)  # broadcasts rank 0's bf16 weights
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = split_batch(synthetic_batch(step, 8, cfg), distlab.rank(), distlab.world_size())
        with track_comm() as comm:
            lm_loss(ddp, x, y).backward()  # bf16 gradients all-reduced
        opt.step()
        if step == steps - 1:
            state = model_state(model, optimizer=opt)
        opt.zero_grad(set_to_none=True)
    return state, comm.stats(), [m.clone() for m in opt.master_params()]


def test_ddp_with_mixed_precision_adam_two_ranks():
    psi = num_params(build_model("tiny"))
    out = distlab.launch(_mixed_ddp_steps, 2, args=(3,))
    (s0, c0, m0), (s1, c1, m1) = out
    for state in (s0, s1):  # every rank holds all of it: 2 + 2 + 12 bytes per parameter
        assert (state.params, state.grads, state.optimizer_state) == (2 * psi, 2 * psi, 12 * psi)
    for comm in (c0, c1):  # one bf16 all-reduce volume: 2 Ψ (N-1)/N x 2 bytes
        assert set(comm.calls) == {"all_reduce"}
        assert comm.total_bytes == comm_bytes_per_rank(psi, 2, stage=0, bytes_per_element=2)
    for a, b in zip(m0, m1):  # fp32 masters stay identical across ranks
        assert torch.equal(a, b)
