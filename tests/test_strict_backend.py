"""The strict backend (distlab.engine.strict): gloo's bytes with NCCL's rules, and the hang report that
works where CPU time cannot tell a waiting rank from a working one."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.engine import launch as launch_mod
from distlab.engine import runtime


def _semantics():
    d, r = distlab.device(), distlab.rank()
    out = {"backend": (dist.get_backend(), distlab.backend())}
    # A synchronous all-reduce: right when read (the read is ordered after it, as on a GPU's stream).
    t = torch.full((4,), float(r + 1), device=d)
    dist.all_reduce(t)
    out["sync"] = t.tolist()
    # An async one read before wait(): NCCL gives stale or half-written bytes; here, the poison.
    u = torch.ones(3, device=d)
    work = dist.all_reduce(u, async_op=True)
    out["before_wait"] = u.clone().tolist()
    work.wait()
    out["after_wait"] = u.tolist()
    # batch_isend_irecv: one Work for the group (NCCL), and the pattern that pairs Works with ops reads poison.
    peer = 1 - r
    first, second = torch.empty(2, device=d), torch.empty(2, device=d)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, peer), dist.P2POp(dist.irecv, second, peer),
                                    dist.P2POp(dist.isend, torch.full((2,), 7.0, device=d), peer),
                                    dist.P2POp(dist.isend, torch.full((2,), 8.0, device=d), peer)])
    out["works"] = len(works)
    used = []
    for part, w in zip([first, second], works):   # the ring solution's old bug (issue 23, #3)
        w.wait()
        used.append(part.tolist())
    out["zip_pairing"] = used
    # Host tensors, whatever their size, are refused in collectives (NCCL: "Tensors must be CUDA").
    refused = []
    for name, make in (("0-dim", lambda: torch.tensor(1.0)), ("1 element", lambda: torch.ones(1)),
                       ("device='cpu'", lambda: torch.ones(1, device="cpu"))):
        try:
            dist.all_reduce(make())
        except distlab.engine.audit.DeviceAuditError:
            refused.append(name)
    out["refused"] = refused
    # A functional collective's result (what DTensor and parallelize_module's layers return) waits for its
    # collective at its first use (wait_tensor): right on NCCL, so never the poison here either.
    import torch.distributed._functional_collectives as funcol
    x = torch.full((4, 3), float(r + 1), device=d)
    out["functional"] = [float((funcol.all_reduce(x, "sum", dist.group.WORLD) * 1.0).sum()) for _ in range(4)]
    out["functional"].append(float(funcol.all_reduce(x.t(), "sum", dist.group.WORLD).sum()))   # non-contiguous
    return out


def _launch_argument(t):
    try:
        dist.all_reduce(t)
    except distlab.engine.audit.DeviceAuditError as exc:
        return "refused: " + str(exc).split(" at ")[1][:len("an argument of launch()")]
    return "accepted"


def test_strict_backend_keeps_nccls_promises(no_orphans):
    out = distlab.launch(_semantics, 2, strict=True)
    for r, o in enumerate(out):
        assert o["backend"] == ("strict", "gloo")
        assert o["sync"] == [3.0] * 4
        assert all(x != x for x in o["before_wait"]), o["before_wait"]   # NaN: the poison
        assert o["after_wait"] == [2.0] * 3
        assert o["works"] == 1
        # Pairing Works with ops (right on gloo) uses only the first received part on NCCL, and here.
        assert o["zip_pairing"] == [[7.0, 7.0]]
        assert o["refused"] == ["0-dim", "1 element", "device='cpu'"]
        assert o["functional"] == [36.0] * 5, o["functional"]     # (1 + 2) x 12 elements, never NaN
    # A tensor that reached the rank as a launch() argument is a host tensor on a GPU box.
    assert distlab.launch(_launch_argument, 2, args=(torch.ones(3),), strict=True) == ["refused: an argument of launch()"] * 2


def _only_rank0_reduces():
    if distlab.rank() == 0:
        dist.all_reduce(torch.ones(1, device=distlab.device()))   # rank 1 never joins
    return "done"


def test_a_collective_no_peer_joins_is_a_stall_on_the_strict_backend(no_orphans):
    # On gloo rank 0 blocks inside all_reduce; on NCCL (and here) it returns at once, both ranks "finish",
    # and only the rank's final synchronisation waits: lecture 00's demo returned "done" on GPUs (#2).
    with pytest.raises(distlab.LaunchStalled) as err:
        distlab.launch(_only_rank0_reduces, 2, stall=2, strict=True)
    assert err.value.ranks == [0]
    assert err.value.where[0].startswith("_only_rank0_reduces (test_strict_backend.py, line")
    assert "allreduce #1" in str(err.value) and "had already returned" in str(err.value)


def test_nccl_watchdog_report_becomes_a_stall(tmp_path):
    """A rank that NCCL's watchdog aborted (no Python error) is reported as a stall naming the op."""
    class Dead:
        exitcode = -6

        def join(self, timeout=None):
            return None
    (tmp_path / "rank1.errlog").write_text(
        "[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=10000) ran for 10001 "
        "milliseconds before timing out.\n")
    err = launch_mod._failure([Dead(), Dead()], str(tmp_path), 1, lambda b: b)
    assert err["type"] == "CollectiveTimeout"
    assert "OpType=ALLREDUCE" in err["message"] and err["message"].startswith("rank 1:")
    assert launch_mod._failure([Dead(), Dead()], str(tmp_path), 0, lambda b: b)["type"] == "ProcessDied"


def test_nccl_groups_time_out_past_the_stall_window_with_a_floor(monkeypatch):
    """NCCL counts from enqueue: its timeout is max(30 s, stall + 10 s); the hang watch reports within the
    stall window (tests/test_watchdog.py)."""
    monkeypatch.delenv("DISTLAB_NCCL_TIMEOUT_S", raising=False)
    assert runtime.group_timeout_s("nccl", 4 * 3600, 60.0) == 70.0
    assert runtime.group_timeout_s("nccl", 4 * 3600, 2.0) == 30.0
    assert runtime.group_timeout_s("gloo", 4 * 3600, 10.0) == 4 * 3600


def test_the_readme_says_what_the_strict_backend_cannot_show():
    """Issue 39, point 6: the list names several streams at once, frees ordered by stream, device-wide
    synchronisation, timeouts counted from enqueue and NCCL's coalescing path."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    para = " ".join(text.split("What it cannot emulate:", 1)[1].split("\n- ", 1)[0].split())
    for item in ("several streams at once", "FSDP2's all-gather", "offload copy stream", "frees ordered by stream",
                 "`record_stream`", "device-wide synchronisation", "`torch.cuda.synchronize()`",
                 "enqueued", "coalescing path", "NCCL's own buffers", "rounding and fragmentation"):
        assert item in para, item
