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


# ---- issue 39: hangs on NCCL, late peers, pipeline stages' waits ---------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _skips_a_collective():
    if distlab.rank() == 0:
        dist.all_reduce(torch.ones(1, device=distlab.device()))     # rank 1 never joins
    return "returned"


@two_gpus
def test_a_hang_on_nccl_is_reported_within_seconds_naming_the_op(no_orphans):
    """The hang watch (distlab.engine.watchdog) reports it after the stall window, long before NCCL's own
    timeout (30 s), with the op and the line that issued it."""
    import time
    start = time.monotonic()
    with pytest.raises(distlab.LaunchStalled) as err:
        distlab.launch(_skips_a_collective, 2, backend="nccl", stall=2)
    assert time.monotonic() - start < 20
    assert err.value.ranks == [0] and "all_reduce" in str(err.value) and "_skips_a_collective" in str(err.value)


def _late_peer(delay_s):
    import time
    if distlab.rank() == 1:                 # a long set-up (host work) before its first collective
        end = time.perf_counter() + delay_s
        while time.perf_counter() < end:
            pass
    t = torch.ones(1, device=distlab.device())
    dist.all_reduce(t)
    return t.item()


@two_gpus
def test_a_late_peer_on_nccl_is_not_a_hang(no_orphans):
    """NCCL counts its timeout from enqueue: with the stall window as its timeout, rank 0 was aborted here."""
    assert distlab.launch(_late_peer, 2, args=(4.0,), backend="nccl", stall=1) == [2.0, 2.0]


def _stage_waits_on_its_stream():
    import time

    from distlab.course.pipeline.fixed_cost import FixedCost
    from distlab.course.pipeline.stages import build_stage
    r, dev = distlab.rank(), distlab.device()
    warm = torch.zeros(1, device=dev)
    if r == 1:
        dist.recv(warm, 0)                              # the pair's communicator exists before the timing
        time.sleep(2.0)
        dist.recv(torch.empty(16 * 2 ** 20, device=dev), 0)
        return 0.0
    dist.send(warm, 1)
    stage = FixedCost(build_stage("tiny", index=0, stages=2, device=dev), forward_s=0.0, backward_s=0.0)
    x = torch.randint(0, stage.config.vocab_size, (2, stage.config.seq_len), device=dev)
    stage(x)                                            # cuBLAS set up before the timing
    # 64 MiB: too big for NCCL to finish before rank 1 posts its recv, two seconds from now
    send = dist.isend(torch.ones(16 * 2 ** 20, device=dev), 1)
    start = time.perf_counter()
    stage(x)
    took = time.perf_counter() - start
    send.wait()
    return took


@two_gpus
def test_a_pipeline_stage_does_not_wait_for_a_send_in_flight(no_orphans):
    """Issue 39, point 2: FixedCost's waits are on its compute stream; a device-wide synchronise would have
    held the forward until the peer posted its recv (2 s)."""
    took, _ = distlab.launch(_stage_waits_on_its_stream, 2, backend="nccl")
    assert took < 1.0, took


def test_the_notebook_kernel_opens_no_cuda_context():
    """Issue 39, point 4, on the real GPU: a fresh interpreter asks as a notebook's kernel does."""
    import subprocess
    import sys
    code = ("import torch; from distlab.engine import precision; precision.describe(); "
            "precision.compute_dtype(torch.bfloat16); print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
