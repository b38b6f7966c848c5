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
    far slower than fp32. The course reads the compute capability (8.0+) instead (issue 23)."""
    import torch

    from distlab.engine import precision
    monkeypatch.delenv("DISTLAB_NATIVE_BF16", raising=False)
    monkeypatch.setattr(precision, "_probe", lambda i: {"name": "Tesla V100", "major": 7, "minor": 0, "hip": False})
    assert precision.native_bf16("cuda:0") is False
    assert precision.compute_dtype(torch.bfloat16, "cuda:0") == torch.float32


def _fake_cuda_without_contexts(monkeypatch):
    """A box with two GPUs (0: V100, 1: A100) where every call that would open a CUDA context in this
    process fails the test; the subprocess probe is replaced by a record of the GPUs asked."""
    import torch

    from distlab.engine import precision
    monkeypatch.delenv("DISTLAB_NATIVE_BF16", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def opens_a_context(*args, **kwargs):
        raise AssertionError("the notebook's kernel opened a CUDA context")
    for name in ("_lazy_init", "init", "get_device_properties", "get_device_name", "get_device_capability",
                 "is_bf16_supported", "current_device", "set_device", "synchronize", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, opens_a_context)
    gpus = {0: {"name": "Tesla V100", "major": 7, "minor": 0, "hip": False},
            1: {"name": "NVIDIA A100", "major": 8, "minor": 0, "hip": False}}
    asked = []
    monkeypatch.setattr(precision, "_probe", lambda i: (asked.append(i), gpus[i])[1])
    return asked


def test_the_notebook_kernel_never_opens_a_cuda_context(monkeypatch):
    """describe(), native_bf16() and compute_dtype() in a kernel (no process group) used to open a context
    on GPU 0 (issue 39, point 4): they ask a subprocess now, about the GPU named."""
    import torch

    from distlab.engine import precision
    asked = _fake_cuda_without_contexts(monkeypatch)
    assert precision.describe().startswith("bf16 weights compute in fp32: Tesla V100 has no native bf16")
    assert precision.compute_dtype(torch.bfloat16) == torch.float32          # the default GPU: 0
    assert precision.native_bf16("cuda:1") is True                            # the device asked is read
    assert precision.describe("cuda:1") == "bf16 weights compute in bf16: NVIDIA A100 has native bf16 arithmetic."
    assert set(asked) == {0, 1}


def test_on_a_rank_the_gpu_asked_is_the_one_read(monkeypatch):
    """On a rank the properties are read in the process, of the device asked, not of the current one
    (is_bf16_supported reads only the current device: wrong on a box with mixed GPU models)."""
    import types

    import torch

    from distlab.engine import precision
    _fake_cuda_without_contexts(monkeypatch)
    monkeypatch.setattr(precision, "_in_rank", lambda: True)
    majors = {0: 7, 1: 9}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=f"gpu{i}", major=majors[i], minor=0))
    assert precision._cuda_native_bf16(torch.device("cuda", 1)) is True
    assert precision._cuda_native_bf16(torch.device("cuda", 0)) is False


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
    _fake_cuda_without_contexts(monkeypatch)
    monkeypatch.setattr(precision, "_probe", lambda i: {"name": "NVIDIA A100", "major": 8, "minor": 0, "hip": False})
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


def test_pipeline_stages_wait_on_their_stream_not_the_whole_device(monkeypatch):
    """FixedCost used torch.cuda.synchronize(): on a GPU that also waits for NCCL's streams, so for a send
    whose receive the peer has not posted yet (issue 39, point 2). It waits on an event recorded on the
    current stream of the stage's device now. Fake CUDA: a device-wide synchronise fails the test."""
    import torch

    from distlab.course.models import synthetic_batch
    from distlab.course.pipeline.fixed_cost import FixedCost
    from distlab.course.pipeline.stages import build_stage

    def device_wide(*args, **kwargs):
        raise AssertionError("a device-wide synchronise inside a pipeline stage")
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

    class Event:
        def record(self, stream):
            self.stream = stream

        def synchronize(self):
            waited.append(self.stream.device)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(torch.device(device)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    stage = FixedCost(build_stage("tiny", index=0, stages=1), forward_s=0.0, backward_s=0.0)
    stage.device = torch.device("cuda", 1)          # as on rank 1 of a GPU box; the tensors stay on the CPU
    x, y = synthetic_batch(0, 2, stage.config)
    logits = stage(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    # forward: before and after; backward: when the output's gradient arrives and when the pass ends
    assert waited == [torch.device("cuda", 1)] * 4
