"""The launcher: results by rank, failures named, hangs bounded, nothing left running."""
import os
import signal
import threading
import time
import _thread

import psutil
import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.engine.launch import resolve_backend, run_on_ranks


def _rank_times_ten(offset):
    t = torch.tensor([float(distlab.rank())])
    dist.all_reduce(t)
    return {"rank": distlab.rank(), "value": distlab.rank() * 10 + offset, "sum": t.item(),
            "world": distlab.world_size(), "threads": torch.get_num_threads(), "pid": os.getpid()}


def test_returns_values_ordered_by_rank(no_orphans):
    out = distlab.launch(_rank_times_ten, 4, args=(1,))
    assert [o["value"] for o in out] == [1, 11, 21, 31]
    assert all(o["sum"] == 6.0 and o["world"] == 4 and o["threads"] == 1 for o in out)
    assert not any(psutil.pid_exists(o["pid"]) and psutil.Process(o["pid"]).status() != psutil.STATUS_ZOMBIE
                   for o in out)


def test_world_size_one_and_kwargs(no_orphans):
    def f(a, *, b):
        return (distlab.rank(), distlab.world_size(), a + b, str(distlab.device()))
    assert distlab.launch(f, 1, args=(2,), kwargs=dict(b=3)) == [(0, 1, 5, "cpu")]


def test_functions_and_classes_defined_in_main_travel(no_orphans):
    # Defined here, in a test module's local scope: only cloudpickle can ship these.
    class Acc:
        def __init__(self):
            self.total = distlab.rank()
    out = distlab.launch(lambda: Acc().total, 2)
    assert out == [0, 1]


def test_output_is_replayed_in_rank_order_with_prefix(capfd, no_orphans):
    def talk():
        import sys as s
        time.sleep(0.05 * (3 - distlab.rank()))  # finish in reverse order
        print(f"hello {distlab.rank()}")
        print(f"oops {distlab.rank()}", file=s.stderr)
        distlab.print0("only rank 0")
    distlab.launch(talk, 3)
    out, err = capfd.readouterr()
    lines = [l for l in out.splitlines() if l.startswith("[rank")]
    assert lines == ["[rank 0] hello 0", "[rank 0] only rank 0", "[rank 1] hello 1", "[rank 2] hello 2"]
    assert [l for l in err.splitlines() if l.startswith("[rank")] == [f"[rank {r}] oops {r}" for r in range(3)]


def _fail_on(bad_rank):
    if distlab.rank() == bad_rank:
        raise ValueError(f"boom on {bad_rank}")
    dist.barrier()  # the others wait for the failed rank forever
    return "unreachable"


def test_rank_failure_names_rank_and_stops_the_rest_quickly(no_orphans):
    start = time.monotonic()
    with pytest.raises(distlab.RankFailed) as info:
        run_on_ranks(_fail_on, 3, args=(1,), timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "rank 1 raised ValueError: boom on 1" in str(info.value)
    assert "_fail_on" in info.value.traceback
    assert isinstance(info.value, distlab.LaunchError)


def _hang_on_rank0():
    if distlab.rank() == 0:
        dist.barrier()  # rank 1 never joins
    return distlab.rank()


def test_deadlock_is_found_within_the_stall_window_and_says_where(no_orphans):
    start = time.monotonic()
    with pytest.raises(distlab.LaunchStalled) as info:
        distlab.launch(_hang_on_rank0, 2, stall=2)
    took = time.monotonic() - start
    assert info.value.ranks == [0]
    assert 1.5 < took < 15, took
    # Where rank 0 waits: the learner's line, not torch's internals.
    assert info.value.where[0].startswith("_hang_on_rank0 (test_launch.py, line ")
    assert "rank(s) [1] had already returned" in str(info.value)
    assert isinstance(info.value, distlab.LaunchTimeout)   # old `except LaunchTimeout` still catches it


def _slow_but_working(seconds):
    # Rank 1 computes for `seconds` (longer than the stall window) before joining the collective;
    # rank 0 waits for it in the all-reduce, idle. Slow is not hung.
    if distlab.rank() == 1:
        end = time.monotonic() + seconds
        x = torch.randn(64, 64)
        while time.monotonic() < end:
            x = torch.tanh(x @ x)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_slow_but_progressing_ranks_are_never_stopped(no_orphans):
    assert distlab.launch(_slow_but_working, 2, args=(4.0,), stall=2) == [2.0, 2.0]   # two stall windows of work


def test_a_process_whose_worker_thread_is_runnable_is_not_idle():
    # A rank's main thread waits on gloo's worker thread (state S) while the worker computes or waits for
    # a core (R): the process counts as working, whatever its main thread's state.
    import subprocess
    import sys
    from distlab.engine import procs
    spin = "import threading\ndef f():\n    while True:\n        pass\nt = threading.Thread(target=f)\nt.start(); t.join()"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(1.0)
        p, q = psutil.Process(busy.pid), psutil.Process(idle.pid)
        assert p.status() == psutil.STATUS_SLEEPING                  # the main thread, in join
        assert any(procs.runnable(p) for _ in range(200))           # the spinning thread, R when sampled
        assert not any(procs.runnable(q) for _ in range(20))
    finally:
        for child in (busy, idle):
            child.kill()
            child.wait()


def test_cap_still_ends_a_launch_that_works_forever(no_orphans):
    start = time.monotonic()
    with pytest.raises(distlab.LaunchTimeout) as info:
        run_on_ranks(_slow_but_working, 2, args=(600.0,), timeout=3)
    assert not isinstance(info.value, distlab.LaunchStalled)
    assert info.value.ranks == [0, 1] and 2.5 < time.monotonic() - start < 15


def test_process_that_dies_without_python_error(no_orphans):
    def die():
        if distlab.rank() == 1:
            os._exit(7)
        dist.barrier()
    with pytest.raises(distlab.RankFailed) as info:
        run_on_ranks(die, 2, timeout=30)
    assert info.value.rank == 1 and "exited with code 7" in str(info.value)


def test_unpicklable_return_value_names_the_rank(no_orphans):
    def give_lock():
        return threading.Lock() if distlab.rank() == 1 else 0
    with pytest.raises(distlab.RankFailed) as info:
        distlab.launch(give_lock, 2)
    assert info.value.rank == 1 and "cannot be pickled" in str(info.value)


def test_keyboard_interrupt_kills_every_rank(tmp_path, no_orphans):
    def sleeper(folder):
        open(os.path.join(folder, f"{distlab.rank()}.pid"), "w").write(str(os.getpid()))
        time.sleep(60)

    def interrupt_when_started():
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    # A process started in the background by a non-interactive shell inherits SIGINT ignored, and Python then
    # installs no handler, so interrupt_main() would do nothing: put Python's own handler (Ctrl-C) in place.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_when_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_on_ranks(sleeper, 2, args=(str(tmp_path),), timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    assert not any(psutil.pid_exists(p) for p in pids)


@pytest.mark.parametrize("bad, exc, msg", [
    (0, ValueError, "at least 1"), (-2, ValueError, "at least 1"),
    (2.0, TypeError, "must be an int"), ("4", TypeError, "must be an int"), (True, TypeError, "must be an int"),
])
def test_bad_world_size_starts_nothing(bad, exc, msg, no_orphans):
    with pytest.raises(exc, match=msg):
        distlab.launch(lambda: 0, bad)


def test_bad_backend_and_nccl_without_gpus():
    with pytest.raises(ValueError, match="not one of"):
        distlab.launch(lambda: 0, 2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA GPUs"):
            resolve_backend("nccl", 1)
        assert resolve_backend("auto", 4) == "gloo"
    else:
        with pytest.raises(ValueError, match="one rank per GPU"):
            resolve_backend("nccl", torch.cuda.device_count() + 1)


def test_unpicklable_function_is_refused_before_starting(no_orphans):
    lock = threading.Lock()
    with pytest.raises(distlab.LaunchError, match="could not send"):
        distlab.launch(lambda: lock.acquire(), 2)
    with pytest.raises(TypeError, match="needs a function"):
        distlab.launch(42, 2)


def test_relaunch_is_fast_enough_to_feel_instant(no_orphans):
    """A sanity bound only (the measured figures come from distlab.bench.launcher)."""
    distlab.launch(lambda: 0, 4)
    start = time.monotonic()
    distlab.launch(lambda: 0, 4)
    assert time.monotonic() - start < 10


def test_function_touching_a_config_attribute_and_dist_travels(no_orphans):
    # cloudpickle alone fails here: `model.config` + `dist` drags in torch.distributed.config,
    # a module of a ModuleType subclass; the launcher ships such modules by name.
    from distlab.course.models import build_model

    def f():
        model = build_model("tiny")
        return model.config.d_model + dist.get_world_size()
    assert distlab.launch(f, 2) == [34, 34]


def _setting():
    import os
    return os.environ.get("DISTLAB_PROBE_SETTING")


def test_ranks_see_the_launchers_settings_of_now_not_the_fork_servers(monkeypatch):
    """The fork server keeps the environment it started with: a $DISTLAB_* setting changed later (by a test's
    monkeypatch, a notebook's %env) must reach the next launch's ranks, and one removed must be gone."""
    monkeypatch.setenv("DISTLAB_PROBE_SETTING", "first")
    assert distlab.launch(_setting, 1) == ["first"]
    monkeypatch.setenv("DISTLAB_PROBE_SETTING", "second")
    assert distlab.launch(_setting, 1) == ["second"]
    monkeypatch.delenv("DISTLAB_PROBE_SETTING")
    assert distlab.launch(_setting, 1) == [None]


def test_a_hang_names_the_notebook_cell_its_line_and_the_rank_that_never_sent(no_orphans):
    # A function defined in a notebook cell: the stuck rank's line is named as the learner sees it, by the
    # cell's execution count and its source, not cloudpickle's "<dynamic-code>".
    from IPython.core.interactiveshell import InteractiveShell
    from distlab.checks.verdict import reason
    from distlab.engine.launch import LaunchStalled
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("import torch, torch.distributed as dist\n\n"
                       "def wait_for_rank_0():\n"
                       "    if dist.get_rank() == 1:\n"
                       "        dist.recv(torch.zeros(1), 0)   # rank 0 never sends\n", store_history=True)
        count = shell.execution_count - 1
        with pytest.raises(LaunchStalled) as info:
            run_on_ranks(shell.user_ns["wait_for_rank_0"], 2, stall=2)
        text = reason(info.value)
    finally:
        InteractiveShell.clear_instance()
    assert text == (f"hung: rank(s) [1] waited 2 s for each other; rank 1 waits in wait_for_rank_0 (cell [{count}], "
                    "line 5: `dist.recv(torch.zeros(1), 0)   # rank 0 never sends`), inside dist.recv; "
                    "rank(s) [0] had already returned, so what the waiting rank(s) expect from it was never sent")


def _steps_with_a_fault_point(steps):
    from distlab.engine.launch import fault_point
    for step in range(steps):
        fault_point("step", step)
        t = torch.ones(1)
        dist.all_reduce(t)                  # the other ranks wait here for the killed one
    return distlab.rank()


def test_an_injected_fault_kills_the_armed_rank_from_outside_and_stops_the_others(no_orphans):
    from distlab.engine.launch import FaultInjected, LaunchError
    with pytest.raises(FaultInjected) as info:
        run_on_ranks(_steps_with_a_fault_point, 3, args=(5,), fault=(1, "step 2"))
    e = info.value
    assert (e.rank, e.point, e.others) == (1, "step 2", [0, 2])
    assert "rank 1 was killed with SIGKILL at step 2" in str(e) and "injected by the launcher" in str(e)
    # unarmed, the points cost nothing; armed at a point no rank reaches, the launch says so
    assert run_on_ranks(_steps_with_a_fault_point, 2, args=(2,)) == [0, 1]
    with pytest.raises(LaunchError, match="never reached"):
        run_on_ranks(_steps_with_a_fault_point, 2, args=(2,), fault=(0, "step 9"))
    with pytest.raises(ValueError, match="ranks 0..1"):
        run_on_ranks(_steps_with_a_fault_point, 2, args=(2,), fault=(2, "step 0"))
