"""What chapter 6 states about fully_shard, on real ranks: 12Ψ/N at rest with SGD momentum, the traffic of the
closed form (root unit included), the same parameters as one process, and a bf16 policy whose bytes do not
depend on whether this CPU computes in bf16."""
from __future__ import annotations

import os

import pytest
import torch

import distlab
from distlab.checks.ch06 import traffic
from distlab.meters import model_state, track_comm
from distlab.course.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch


def _fsdp_steps(reshard: bool, steps: int = 3):
    from torch.distributed.fsdp import fully_shard
    cfg = PRESETS["tiny"]
    model = build_model("tiny")
    for block in model.blocks:
        fully_shard(block, mesh=distlab.mesh(), reshard_after_forward=reshard)
    fully_shard(model, mesh=distlab.mesh(), reshard_after_forward=reshard)
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


@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_traffic_memory_and_values(reshard):
    psi = num_params(build_model("tiny"))
    ref = _single()
    want = traffic(psi, 0, 1, 2, 4, reshard)      # explicit True reshards the root too: 3Ψ; False: 2Ψ
    for state, comm, params in distlab.launch(_fsdp_steps, 2, args=(reshard,)):
        assert comm.bytes == {"all_gather": want["all_gather"], "reduce_scatter": want["reduce_scatter"]}
        # At rest: fp32 param + grad + momentum shards, 12 B per parameter / N.
        assert state.total == 12 * psi // 2
        for k, v in ref.items():
            torch.testing.assert_close(params[k], v.detach(), atol=1e-5, rtol=1e-4)


def _bf16_policy(native: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    os.environ["DISTLAB_NATIVE_BF16"] = native          # read at every forward: forces the detection
    cfg = PRESETS["tiny"]
    model = build_model("tiny")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=distlab.mesh(), mp_policy=mp)
    fully_shard(model, mesh=distlab.mesh(), mp_policy=mp)
    seen = []
    model.blocks[0].qkv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, y = split_batch(synthetic_batch(0, 8, cfg), distlab.rank(), distlab.world_size())
    with track_comm() as comm:
        lm_loss(model, x, y).backward()
    gathered = {str(p.dtype) for p in model.parameters()}
    return seen, comm.stats(), gathered


def test_the_bf16_policy_sends_bf16_bytes_whatever_the_compute_dtype():
    psi = num_params(build_model("tiny"))
    root = psi - sum(p.numel() for p in build_model("tiny").blocks.parameters())
    fallback = distlab.launch(_bf16_policy, 2, args=("0",))
    native = distlab.launch(_bf16_policy, 2, args=("1",))
    assert fallback[0][0] == [torch.float32] and native[0][0] == [torch.bfloat16]   # what the matmuls ran in
    for (_, a, _), (_, b, _) in zip(fallback, native):
        assert a.bytes == b.bytes                        # the recipe's bytes, unchanged by the fallback
        assert a.bytes["all_gather"] == traffic(psi, root, 1, 2, 2)["all_gather"]      # 2 B gathers
        assert a.bytes["reduce_scatter"] == traffic(psi, root, 1, 2, 4)["reduce_scatter"]   # fp32 reduction
    assert fallback[0][2] == {"torch.float32"}           # the shards (master weights) stay fp32
