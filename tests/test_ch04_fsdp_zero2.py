"""Chapter 4's claims about fully_shard(reshard_after_forward=False), on real ranks.

At a step boundary FSDP2 keeps parameters, gradients and optimizer state sharded (16 B/param / N with
MixedPrecisionAdam on the DTensor shards), and one step sends 2*Psi*b*(N-1)/N: one all-gather and one
reduce-scatter per unit; its peak holds the unsharded parameters during forward and backward.
"""
from __future__ import annotations

import pytest
import torch

import distlab
from distlab.meters import model_state, track_comm, track_memory
from distlab.course.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.theory import comm_bytes_per_rank


def _fsdp_step(track_mem: bool):
    from torch.distributed.fsdp import fully_shard
    preset = "small" if track_mem else "tiny"
    model = build_model(preset).to(torch.bfloat16)
    mesh = distlab.mesh()   # on the rank's device type (required: see distlab.engine.runtime.mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-3)
    x, y = split_batch(synthetic_batch(0, 8, PRESETS[preset]), distlab.rank(), distlab.world_size())
    if track_mem:  # one short sequence per rank: activations are far below the parameters
        x, y = x[:1, :8], y[:1, :8]
        lm_loss(model, x, y).backward()  # warm-up: optimizer state exists before tracking
        opt.step()
        opt.zero_grad()
        with track_memory() as mem:
            lm_loss(model, x, y).backward()
            opt.step()
        return mem.peak_bytes
    with track_comm() as comm:
        lm_loss(model, x, y).backward()
        opt.step()
    return model_state(model, optimizer=opt), comm.stats()


def test_fully_shard_without_reshard_sends_zero2_bytes_and_shards_states():
    n, psi = 2, num_params(build_model("tiny"))
    for state, comm in distlab.launch(_fsdp_step, n, args=(False,)):
        assert set(comm.calls) == {"all_gather", "reduce_scatter"}
        assert comm.calls["all_gather"] == comm.calls["reduce_scatter"]  # one of each per unit
        assert comm.total_bytes == comm_bytes_per_rank(psi, n, stage=2, bytes_per_element=2)
        # Parameters too are sharded between steps (unlike textbook ZeRO-2): 16 B/param / N in all.
        assert state.total == pytest.approx(16 * psi / n, rel=0.01)


def test_track_memory_sees_fully_shard_unsharded_parameters():
    # The CPU tracker books FSDP2's storage resizes: the parameters unsharded for forward (2 B each on
    # every rank, kept through backward with reshard_after_forward=False) must show in a step's peak.
    n, psi = 2, num_params(build_model("small"))
    for peak in distlab.launch(_fsdp_step, n, args=(True,)):
        assert peak >= 2 * psi


def _zero2_bytes(native: str):
    # The lecture's fully_shard(reshard_after_forward=False) step, with the compute dtype forced:
    # '0' = fp32 arithmetic on bf16 weights (CPUs without native bf16), '1' = bf16 arithmetic.
    import os
    os.environ["DISTLAB_NATIVE_BF16"] = native
    from distlab.engine.precision import compute_dtype
    state, comm = _fsdp_step(False)
    return compute_dtype(torch.bfloat16), state, comm


def test_recorded_bytes_do_not_depend_on_the_compute_dtype():
    # The lesson is the recipe's bytes: bf16 storage and traffic, whatever the arithmetic runs in.
    fp32 = distlab.launch(_zero2_bytes, 2, args=("0",))
    bf16 = distlab.launch(_zero2_bytes, 2, args=("1",))
    assert [o[0] for o in fp32] == [torch.float32] * 2 and [o[0] for o in bf16] == [torch.bfloat16] * 2
    for a, b in zip(fp32, bf16):
        assert a[1] == b[1]                                   # model states, byte for byte
        assert a[2].bytes == b[2].bytes and a[2].calls == b[2].calls   # algorithmic bytes per collective
