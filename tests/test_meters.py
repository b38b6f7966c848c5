"""The meters measure: exact bytes on known allocations, known traffic on real ranks."""
import time

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import theory
from distlab.meters import Timeline, model_state, track_comm, track_memory
from distlab.course.models import build_model, lm_loss, num_params, split_batch, synthetic_batch


def test_memory_exact_on_known_allocations():
    before = torch.empty(10_000)  # exists before tracking: never counted
    with track_memory("cpu") as mem:
        a = torch.empty(1000)                          # 4000 B
        b = torch.empty(2000, dtype=torch.float64)     # 16000 B
        c = torch.empty(300, dtype=torch.bfloat16)     # 600 B
        assert (mem.current_bytes, mem.peak_bytes) == (20_600, 20_600)
        del b
        assert (mem.current_bytes, mem.peak_bytes) == (4_600, 20_600)
        view = a.view(10, 100)  # a view allocates nothing
        a.add_(1)               # neither does an in-place op
        before.mul_(2)          # nor an op on a tensor from before
        t = before.t() if before.dim() == 2 else before.view(100, 100).t()
        assert mem.current_bytes == 4_600
        d = torch.ones(50) + 1  # a temporary (ones) is freed, the result stays
        assert mem.current_bytes == 4_600 + 200
        assert mem.peak_bytes == 20_600
    assert mem.stats().peak_bytes == 20_600
    del view, t, c, d


def test_memory_counts_what_a_training_step_creates():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with track_memory("cpu") as mem:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    n = sum(p.numel() for p in model.parameters())
    state = model_state(model, optimizer=opt)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert state.params == 4 * n
    assert state.grads == 4 * n
    assert state.optimizer_state == state_bytes  # m, v and the step counters
    assert 8 * n <= state_bytes <= 8 * n + 64
    # grads and m, v were born inside the block and are still alive
    assert mem.current_bytes >= 4 * n + 8 * n
    assert mem.peak_bytes > mem.current_bytes  # activations came and went


def test_model_state_counts_shared_storage_once():
    flat = torch.zeros(100)
    views = [flat[:60], flat[60:]]
    s = model_state(views, grads=[flat[:10]], optimizer=[])
    assert s.params == 400 and s.grads == 0 and s.total == 400


def _ddp_step_traffic():
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(build_model("tiny"))
    x, y = split_batch(synthetic_batch(0, 12, model.module.config), distlab.rank(), distlab.world_size())
    lm_loss(model, x, y).backward()  # first step: DDP may rebuild its buckets
    with track_comm() as comm:
        lm_loss(model, x, y).backward()
    return comm.stats(), num_params(model.module)


@pytest.mark.parametrize("n", [2, 3])
def test_comm_counts_ddp_reducer_bytes(n, no_orphans):
    results = distlab.launch(_ddp_step_traffic, n)
    for stats, psi in results:
        expected = theory.comm_bytes_per_rank(psi, n, stage=0, bytes_per_element=4)
        assert stats.bytes["all_reduce"] == pytest.approx(expected, rel=1e-6)
        assert stats.calls["all_reduce"] >= 1


def _every_collective():
    from distlab.engine.collectives import all_gather_tensor, reduce_scatter_tensor
    n, r, dev = distlab.world_size(), distlab.rank(), distlab.device()
    t = torch.ones(12, device=dev)
    with track_comm() as comm:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        all_gather_tensor(torch.empty(12 * n, device=dev), t)
        reduce_scatter_tensor(torch.empty(12 // n, device=dev), t)
        dist.all_to_all_single(torch.empty(12, device=dev), t)
        if r == 0:
            dist.send(t, 1)
        elif r == 1:
            dist.recv(t, 0)
        work = dist.isend(t, (r + 1) % n)
        dist.recv(torch.empty(12, device=dev), (r - 1) % n)
        work.wait()
    return comm.stats()


def test_comm_bytes_follow_each_collectives_semantics(no_orphans):
    s = distlab.launch(_every_collective, 4)
    b = 48  # 12 float32
    assert s[0].bytes["all_reduce"] == 2 * 3 * b // 4          # 2(N-1)/N x S
    assert s[0].bytes["broadcast"] == b                         # S
    assert s[0].bytes["all_gather"] == 3 * b                    # (N-1)/N x (N x 48)
    assert s[0].bytes["reduce_scatter"] == 3 * b // 4           # (N-1)/N x 48
    assert s[0].bytes["all_to_all"] == 3 * b // 4               # what leaves for the 3 others
    assert s[0].bytes["send"] == 2 * b and s[0].calls["send"] == 2
    assert s[1].bytes["recv"] == 0 and s[1].calls["recv"] == 2
    assert s[2].calls.get("send") == 1 and "all_reduce" in s[3].calls


def _timeline_job():
    tl = Timeline()
    with tl.span("compute"):
        sum(range(10_000))
    work = tl.track("all_reduce", dist.all_reduce(torch.ones(1000, device=distlab.device()), async_op=True))
    work.wait()
    time.sleep(0.01)  # let the completion callback run
    return tl.finish()


def test_timeline_records_compute_and_async_comm(no_orphans):
    spans = [s for per_rank in distlab.launch(_timeline_job, 2) for s in per_rank]
    assert {(s.rank, s.kind) for s in spans} == {(0, "compute"), (0, "comm"), (1, "compute"), (1, "comm")}
    assert all(s.end >= s.start for s in spans)
    from distlab.viz.plots import timeline
    assert timeline(spans).axes[0].get_xlabel() == "time (ms)"


def test_memory_books_storage_resizes():
    with track_memory("cpu") as mem:
        t = torch.empty(1000)                 # 4000 B
        t.untyped_storage().resize_(0)        # freed the FSDP2 way
        assert mem.current_bytes == 0
        t.untyped_storage().resize_(8000)     # allocated again
        assert (mem.current_bytes, mem.peak_bytes) == (8000, 8000)
    assert mem.stats().current_bytes == 8000
    assert torch.UntypedStorage.resize_.__name__ == "resize_" and "booking" not in repr(torch.UntypedStorage.resize_)


def _fsdp_memory():
    from torch.distributed.fsdp import fully_shard
    with track_memory() as mem:
        model = build_model("tiny")
        for block in model.blocks:
            fully_shard(block, mesh=distlab.mesh())
        fully_shard(model, mesh=distlab.mesh())
        built = mem.current_bytes
        x, y = split_batch(synthetic_batch(0, 8, model.config), distlab.rank(), distlab.world_size())
        lm_loss(model, x, y).backward()
    state = model_state(model)
    return built, mem.peak_bytes, state.params, num_params(model)


def test_memory_tracks_fsdp2_dtensor_params(no_orphans):
    for built, peak, params, psi in distlab.launch(_fsdp_memory, 2):
        assert params == pytest.approx(4 * psi / 2, rel=0.02)    # each rank holds half (+ padding)
        assert peak > built >= params                             # gathered units came and went


def _untimed_gloo_work():
    from distlab.engine.collectives import all_gather_tensor
    tl = Timeline()
    inp = torch.ones(10, device=distlab.device())
    work = tl.track("all_gather", all_gather_tensor(torch.empty(20, device=distlab.device()), inp, async_op=True))
    work.wait()
    return tl.finish()


def test_timeline_tracks_works_without_a_future(no_orphans):
    spans = distlab.launch(_untimed_gloo_work, 2)
    assert [(s.name, s.kind) for s in spans[0]] == [("all_gather", "comm")]


def _reduce_scatter_both_ways():
    from distlab.engine.collectives import reduce_scatter_tensor
    n, r = distlab.world_size(), distlab.rank()
    inp = torch.arange(6 * n, dtype=torch.float32, device=distlab.device()).view(2 * n, 3) * (r + 1)
    out = torch.empty(2, 3, device=distlab.device())
    with track_comm() as comm:
        reduce_scatter_tensor(out, inp)
    expected = torch.arange(6 * n, dtype=torch.float32, device=out.device).view(2 * n, 3)[2 * r:2 * r + 2]
    expected = expected * sum(range(1, n + 1))
    return torch.equal(out, expected), comm.stats()


def test_reduce_scatter_wrapper_values_and_bytes(no_orphans):
    for ok, stats in distlab.launch(_reduce_scatter_both_ways, 3):
        assert ok
        assert stats.calls == {"reduce_scatter": 1} and stats.bytes["reduce_scatter"] == 2 * 24


def _temporary_into_a_collective(iterations: int, functional: bool) -> tuple[int, int]:
    """A temporary handed to a collective (a synchronous all-gather, or DTensor's functional all-reduce and
    its wait) and dropped once it is done, then an allocation and a read: (reads whose peak was not the
    allocation's bytes alone, times gloo's worker thread dropped the temporary last)."""
    import threading
    import weakref
    from torch.distributed import _functional_collectives as funcol
    program, worker_last, wrong = threading.get_ident(), [0], 0

    def dropped() -> None:
        worker_last[0] += threading.get_ident() != program

    flat = torch.zeros(4096 * dist.get_world_size(), device=distlab.device())
    with track_memory() as mem:
        for _ in range(iterations):
            mem.reset_peak()
            if functional:                                       # 16 KiB the op holds: its output
                x = funcol.wait_tensor(funcol.all_reduce(flat[:4096], "sum", dist.group.WORLD))
            else:                                                # ... or its input
                x = flat[:4096].clone()
                dist.all_gather_into_tensor(flat, x)
            weakref.finalize(x.untyped_storage(), dropped)
            del x
            y = torch.empty(8192, device=distlab.device())      # 32 KiB: the phase's whole peak
            del y
            wrong += mem.peak_bytes != 32768
    return wrong, worker_last[0]


@pytest.mark.parametrize("functional, iterations", [(False, 80), (True, 200)], ids=["c10d", "functional"])
def test_memory_does_not_count_a_collectives_hold_on_a_dropped_temporary(functional, iterations, no_orphans):
    # gloo marks the op done before its worker thread drops the op's tensors: without the correction,
    # the temporary is often still alive when `y` is allocated, and the peak reads 48 KiB.
    # Iterations: gloo's worker dropped the temporary last in about 1 in 8 c10d calls per rank here (a c10d
    # call costs ~50 ms, the meter's grace): 80 on 2 ranks leave that case unseen with a chance near 1e-9.
    # Functional calls cost ~5 ms and the worker is last less often: they keep their 200.
    # With the suite pinned to one core the worker was never last in one launch (the scheduler let it finish
    # before the program went on): up to three launches, then a skip that says so rather than a pass.
    for _ in range(3):
        out = distlab.launch(_temporary_into_a_collective, 2, args=(iterations, functional), backend="gloo")
        assert [wrong for wrong, _ in out] == [0, 0]
        if sum(last for _, last in out) > 0:
            return
    pytest.skip("gloo's worker never dropped a temporary last in 3 launches on this machine: the case the "
                "meter corrects did not occur, so nothing was tested")


def test_one_storage_walker_counts_each_storage_once_and_optimizer_groups_on_request():
    from distlab.meters.memory import held_bytes, storages
    model = torch.nn.Linear(4, 2)                                  # 10 fp32 parameters: 40 bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = {"a": model.weight, "b": model.weight.view(-1)}       # a view: the same storage, once
    assert held_bytes(model, shared) == 40
    assert held_bytes(opt) == 0 and sum(storages(opt, optimizer_groups=True).values()) == 40
    assert set(storages(model)) == {("cpu", model.weight.data_ptr()), ("cpu", model.bias.data_ptr())}
