"""The GPU tests' rank functions, run on gloo CPU ranks: what `distlab doctor --gpu` runs must at least run.

tests/test_gpu.py is skipped without CUDA, so a plain mistake in one of its rank functions (a shape
error, a missing import) would only show on a GPU box, where `doctor --gpu` could then never pass.
Here each runs on 2 CPU ranks and its device-independent results are checked; the CUDA-only
assertions stay in test_gpu.py.
"""

import distlab
from test_gpu import _ddp_step, _fsdp_step, _memory, _placement, _race, _timelines


def _every_rank_function():
    return {"placement": _placement(), "timelines": _timelines(), "race": _race(), "ddp": _ddp_step(),
            "fsdp": _fsdp_step(), "memory": _memory() if distlab.rank() == 0 else None}


def test_the_gpu_tests_rank_functions_run_on_cpu_ranks(no_orphans):
    out = distlab.launch(_every_rank_function, 2, backend="gloo")
    for r, res in enumerate(out):
        assert res["placement"] == ("gloo", "cpu", 8.0)
        durations, kinds = res["timelines"]
        assert len(durations) == 1 and durations[0] > 0 and "compute" in kinds and "comm" in kinds, res["timelines"]
        assert res["race"] is True
        where, sent, psi = res["ddp"]
        assert where == "cpu" and abs(sent - 2 * psi * 4 * (2 - 1) / 2) <= 64, (sent, psi)
        assert res["fsdp"] == ("cpu", True)
    current, peak_phase, where = out[0]["memory"]
    assert where == "cpu" and current == 4 * 2 ** 20 and peak_phase == 2 * 4 * 2 ** 20


def test_bf16_emulated_on_a_pre_ampere_gpu_is_not_native(monkeypatch):
    """torch.cuda.is_bf16_supported() counts emulation by default: a V100 or T4 would compute bf16 emulated,
    far slower than fp32. The course asks for hardware bf16 (issue 23, a likely point, now fixed)."""
    import torch

    from distlab.engine import precision
    monkeypatch.delenv("DISTLAB_NATIVE_BF16", raising=False)
    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return including_emulation          # a pre-Ampere GPU: only through emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert precision.native_bf16("cuda:0") is False
    assert asked == [False]
    assert precision.compute_dtype(torch.bfloat16, "cuda:0") == torch.float32


def test_launch_backend_follows_distlab_backend(monkeypatch):
    """`distlab grade --backend gloo` sets $DISTLAB_BACKEND: a check's reference (chapter 8's offload step
    launches one) then runs on the learner's backend, not on NCCL because the box has a GPU."""
    import pytest

    import distlab
    monkeypatch.setenv("DISTLAB_BACKEND", "nccl")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs"):
        distlab.launch(lambda: None, 1)


def test_compute_dtype_in_a_kernel_asks_the_gpu_not_the_host_cpu(monkeypatch):
    """Lecture 07 picks DTYPE in the notebook's kernel (no process group): on a GPU box the answer is the
    GPU's, not the host CPU's (an A100 box with an AVX2 host computes in bf16)."""
    import torch

    from distlab.engine import precision
    monkeypatch.delenv("DISTLAB_NATIVE_BF16", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(precision, "_cpu_native_bf16", lambda: False)
    assert precision.compute_dtype(torch.bfloat16) == torch.bfloat16


def test_torchrun_nodes_agree_on_one_backend():
    """A node without a GPU per local rank would join with gloo while the others join with NCCL, and hang:
    the ranks compare their choices through the store first (issue 23, mixed backends across nodes)."""
    import datetime
    import socket

    import pytest
    import torch.distributed as dist

    from distlab.engine.runtime import agree_on_backend
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    store.set("distlab/backend/1", "nccl gpu-node")
    assert agree_on_backend(store, 0, 2, "nccl") == "nccl"
    store = dist.HashStore()
    store.set("distlab/backend/1", "nccl gpu-node")
    with pytest.raises(RuntimeError, match=f"gloo on {socket.gethostname()}; nccl on gpu-node") as err:
        agree_on_backend(store, 0, 2, "gloo")
    assert "DISTLAB_BACKEND=gloo" in str(err.value)
