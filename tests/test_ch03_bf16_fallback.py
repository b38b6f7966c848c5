"""Chapter 3's measurement records the recipe's bytes whether bf16 is computed natively or in fp32.

On a CPU without native bf16 the course model computes in fp32 while storing bf16
(`distlab.engine.precision.compute_dtype`). The lesson is the bytes: this runs the chapter's
measurement (`distlab.course.data_parallel.measure.measure` + `record_strategy`, as solutions/03_zero1 does,
at the 'tiny' size) with the detection forced off and on, and asserts that the recorded
model-state and traffic bytes are the same, and the recipe's.
"""
from __future__ import annotations

import os
import sys

import cloudpickle
import torch

import distlab
from distlab.meters.records import load_records
from labkit import answers

# The rank functions below travel by value: by reference, every rank would import this test module (and
# labkit, nbformat, ...) at every launch, seconds each on a busy machine.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _build_with(ShardedOptimizer):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from distlab.course.data_parallel.ddp import TorchDDP
    from distlab.course.data_parallel.measure import Strategy
    from distlab.engine.precision import MixedPrecisionAdam

    def build(name, model):   # the notebook's build(), for the strategies it records
        if name == "zero1":
            return Strategy(model, ShardedOptimizer(model.parameters(), MixedPrecisionAdam, lr=1e-3))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=MixedPrecisionAdam, lr=1e-3)
        return Strategy(TorchDDP(model), opt, state_of=opt.optim)
    return build


def _measure_forced(native: str, build, names: tuple[str, ...]) -> list[dict]:
    """On every rank: the chapter's measurement of each strategy with DISTLAB_NATIVE_BF16 forced; and what it
    computed in (one launch for both strategies)."""
    os.environ["DISTLAB_NATIVE_BF16"] = native
    from distlab.course.data_parallel.measure import measure
    from distlab.engine.precision import compute_dtype
    outs = []
    for name in names:
        out = measure(build, name, preset="tiny", dtype=torch.bfloat16, batch_size=4, steps=3)
        out["compute_dtype"] = str(compute_dtype(torch.bfloat16))
        outs.append(out)
    return outs


def test_model_state_and_traffic_bytes_do_not_depend_on_native_bf16(tmp_path, monkeypatch, no_orphans):
    from distlab.course.data_parallel.measure import record_strategy
    from distlab.course.models import build_model, num_params
    from distlab.theory import comm_bytes_per_rank, zero_memory_per_device
    build = _build_with(answers("03_zero1").ShardedOptimizer)
    psi, n = num_params(build_model("tiny")), 2
    for native in ("0", "1"):
        monkeypatch.setenv("DISTLAB_RESULTS", str(tmp_path / native))
        names = ("zero1", "zero1_torch")
        by_rank = distlab.launch(_measure_forced, n, args=(native, build, names))
        for k, name in enumerate(names):
            outs = [per_rank[k] for per_rank in by_rank]
            assert {o["compute_dtype"] for o in outs} == {"torch.float32" if native == "0" else "torch.bfloat16"}
            record_strategy(name, world_size=n, num_params=psi, recipe="bf16+fp32 Adam", preset="tiny",
                            measured=outs[0], predicted_model_state_bytes={}, predicted_comm_bytes_per_step=0,
                            samples_per_s=0.0, max_abs_param_diff_vs_single=0.0)
    fallback, native = (load_records(tmp_path / k)["strategies"] for k in ("0", "1"))
    keys = ("name", "model_state_bytes", "comm_bytes_per_step")
    assert [{k: r[k] for k in keys} for r in fallback] == [{k: r[k] for k in keys} for r in native]
    zero1 = fallback[0]
    assert sum(zero1["model_state_bytes"].values()) == zero_memory_per_device(psi, n, stage=1)   # Psi divides by 2
    assert zero1["comm_bytes_per_step"] == comm_bytes_per_rank(psi, n, stage=1, bytes_per_element=2)
