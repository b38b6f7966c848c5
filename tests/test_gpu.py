"""On a CUDA machine: the NCCL path, the meters on the device, FSDP on a CUDA mesh, GPU timelines.

Marked `gpu`: `distlab doctor --gpu` runs them (`pytest -m gpu tests/`); on a machine
without CUDA they are skipped. NCCL runs one rank per GPU, so N = the GPU count.
"""
import pytest
import torch
import torch.distributed as dist

import distlab

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _n() -> int:
    return torch.cuda.device_count()


def _placement():
    t = torch.ones(4, device=distlab.device())
    dist.all_reduce(t)
    return distlab.backend(), str(distlab.device()), t.sum().item()


def test_nccl_ranks_each_get_their_gpu(no_orphans):
    n = _n()
    out = distlab.launch(_placement, n, backend="nccl")
    assert out == [("nccl", f"cuda:{r}", 4.0 * n) for r in range(n)]


def _memory():
    from distlab.meters import track_memory
    x = torch.randn(256, device=distlab.device())   # warm up the allocator and the context
    with track_memory() as mem:
        block = torch.empty(2 ** 20, device=distlab.device())   # 4 MiB: a multiple of the 512 B rounding
        current = mem.current_bytes
        mem.reset_peak()
        tmp = block * 2
        del tmp
        peak_phase = mem.peak_bytes
    return current, peak_phase, x.device.type


def test_memory_meter_reads_the_cuda_allocator(no_orphans):
    current, peak_phase, where = distlab.launch(_memory, 1, backend="nccl")[0]
    assert where == "cuda" and current == 4 * 2 ** 20
    assert peak_phase == 2 * 4 * 2 ** 20      # the block and its doubled copy


def _ddp_step():
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distlab.meters import track_comm
    from distlab.course.models import build_model, lm_loss, num_params, split_batch, synthetic_batch
    model = build_model("tiny")
    ddp = DDP(model)
    x, y = split_batch(synthetic_batch(0, 8 * distlab.world_size(), model.config), distlab.rank(),
                       distlab.world_size())
    with track_comm() as comm:
        lm_loss(ddp, x, y).backward()
    return str(next(model.parameters()).device), comm.total_bytes, num_params(model)


def test_ddp_on_nccl_sends_the_ring_bytes(no_orphans):
    n = _n()
    out = distlab.launch(_ddp_step, n, backend="nccl")
    for r, (where, sent, psi) in enumerate(out):
        assert where == f"cuda:{r}"
        assert abs(sent - 2 * psi * 4 * (n - 1) / n) <= 64, (sent, psi)


def _fsdp_step():
    from torch.distributed.fsdp import fully_shard

    from distlab.meters import model_state
    from distlab.course.models import build_model, lm_loss, synthetic_batch
    model = build_model("tiny")
    for block in model.blocks:
        fully_shard(block, mesh=distlab.mesh())
    fully_shard(model, mesh=distlab.mesh())
    x, y = synthetic_batch(0, 4, model.config)
    lm_loss(model, x, y).backward()
    w = model.blocks[0].fc.weight
    return w.to_local().device.type, model_state(model).grads > 0


def test_fully_shard_on_a_cuda_mesh(no_orphans):
    assert distlab.launch(_fsdp_step, _n(), backend="nccl") == [("cuda", True)] * _n()


def _timelines():
    from distlab.meters import Timeline, profile_spans
    tl = Timeline()
    t = torch.ones(2 ** 20, device=distlab.device())
    work = tl.track("all-reduce", dist.all_reduce(t, async_op=True))
    work.wait()
    spans = tl.finish()

    def step():
        from torch.profiler import record_function
        with record_function("fwd step"):
            m = t[:256 * 256].view(256, 256)
            (m @ m).sum()
        dist.all_reduce(t)

    prof = profile_spans(step)
    return [s.end - s.start for s in spans], sorted({s.kind for s in prof})


def test_timelines_see_device_time(no_orphans):
    n = _n()
    for durations, kinds in distlab.launch(_timelines, n, backend="nccl"):
        assert len(durations) == 1 and durations[0] > 0
        assert "compute" in kinds and ("comm" in kinds or n == 1)


def test_bf16_computes_natively_on_the_gpu():
    from distlab.engine.precision import compute_dtype, native_bf16
    assert native_bf16("cuda") and compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16


def _race():
    from distlab.bench.race import race
    a = torch.randn(1024, 1024, device=distlab.device())
    result = race({"matmul": lambda: a @ a, "add": lambda: a + a}, repeats=5)
    return result.median("matmul") > 0 and result.repeats == 5


def test_race_times_the_kernels(no_orphans):
    assert all(distlab.launch(_race, _n(), backend="nccl"))
