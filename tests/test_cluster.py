"""Leaving one machine: exported answers under torchrun, two agents on this machine as two nodes
(`distlab.run_under_torchrun` is tested here: the same worker code that `distlab.launch` runs).

Real torchrun agents (c10d rendezvous on 127.0.0.1, gloo), 2 ranks each: the DDP and ZeRO-3
labs' solutions train in one job (on the 'tiny' model: the job's mechanics are under test, not its
size); the records are merged by rank 0; a killed agent or a failing rank ends the job with a message
naming the node, and nothing is left running.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distlab.apps.export import export, module_source, parse_labs

ROOT = Path(__file__).resolve().parents[1]
LABS = ("02_ddp", "05_zero3")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(job: Path, out: Path, *extra: str, steps: int = 3, nproc: int = 2) -> list[subprocess.Popen]:
    """Two torchrun agents (two "nodes") of `nproc` ranks, each in its own session so it can be ended whole."""
    port = _port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DISTLAB_DEVICE_AUDIT", None)
    procs = []
    for node in range(2):
        log = open(out / f"agent{node}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"test-{port}", "job.py", "--out", str(out / "results"), "--steps", str(steps),
             "--preset", "tiny", *extra],
            cwd=job, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 240, after_failure: float = 30) -> list[int | None]:
    """Each agent's exit code, None for one still running when waiting ended: at `timeout`, or
    `after_failure` s after an agent failed (the others would wait out torchrun's 300 s exit barrier)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + after_failure)
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    for p in procs:   # whatever happened, nothing of the job stays behind
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return codes


def _job_processes(job: Path) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(job) and "job.py" in " ".join(p.cmdline()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def test_export_parses_labs_and_writes_module_job_and_sbatch(tmp_path):
    assert parse_labs(["02_ddp", "a.ipynb", "05_zero3"]) == [("02_ddp", Path("a.ipynb")), ("05_zero3", None)]
    with pytest.raises(ValueError):
        parse_labs(["a.ipynb"])
    paths = export([(lab, None) for lab in LABS], tmp_path)
    assert sorted(p.name for p in paths) == ["README.md", "answers_02_ddp.py", "answers_05_zero3.py", "job.py",
                                             "job.sbatch"]
    src = (tmp_path / "answers_05_zero3.py").read_text()
    compile(src, "answers_05_zero3.py", "exec")
    assert "class ZeRO3" in src and "### BEGIN SOLUTION" not in src
    assert "torchrun --nnodes" in (tmp_path / "job.sbatch").read_text()
    with pytest.raises(ValueError, match="has no cluster job"):
        export([("01_collectives", None)], tmp_path)


def test_two_nodes_train_the_ddp_and_zero3_solutions(tmp_path):
    export([(lab, None) for lab in LABS], tmp_path)
    codes = _finish(_agents(tmp_path, tmp_path))
    logs = [(tmp_path / f"agent{k}.log").read_text() for k in range(2)]
    assert codes == [0, 0], logs
    merged = [json.loads(line) for line in (tmp_path / "results" / "strategies.jsonl").read_text().splitlines()]
    assert [m["lab"] for m in merged] == list(LABS)
    for m in merged:
        assert m["world_size"] == 4 and m["nodes"] == 2 and m["backend"] == "gloo"
        assert m["max_abs_param_diff_vs_single"] < 1e-4, m
        assert abs(m["comm_bytes_per_step"] / m["predicted_comm_bytes_per_step"] - 1) < 0.02, m
        assert len(m["peak_bytes_per_rank"]) == 4
    nodes = sorted((tmp_path / "results").glob("node*.jsonl"))
    assert [p.name for p in nodes] == ["node0.jsonl", "node1.jsonl"]
    assert all(len(p.read_text().splitlines()) == 2 * len(LABS) for p in nodes)   # 2 ranks x 2 labs per node
    assert not _job_processes(tmp_path)


def test_a_failing_rank_names_its_node_and_a_killed_agent_ends_the_job(tmp_path):
    # One rank per node here (two ranks per node train in the test above): half the processes to start.
    # 1. The learner's class raises on rank 1 only: the job ends, and the message names rank 1's node.
    export([("02_ddp", None)], tmp_path)
    module = tmp_path / "answers_02_ddp.py"
    module.write_text(module.read_text().replace(
        "class BucketedDDP(torch.nn.Module):",
        "class BucketedDDP(torch.nn.Module):\n    def __new__(cls, *a, **k):\n"
        "        if dist.get_rank() == 1:\n            raise RuntimeError('boom on rank 1')\n"
        "        return super().__new__(cls)\n", 1))
    codes = _finish(_agents(tmp_path, tmp_path, nproc=1))
    text = "".join((tmp_path / f"agent{k}.log").read_text() for k in range(2))
    assert codes != [0, 0]
    assert "distlab: rank 1 (node " in text and "boom on rank 1" in text, text[-3000:]
    assert not _job_processes(tmp_path)

    # 2. One node's agent is killed midway: the other node's ranks stop with a clear error, no hang.
    # A fresh folder: part 1's node files must not count as "both nodes are up" (a kill before
    # the rendezvous completes would leave node 0 waiting out torchrun's join timeout).
    job = tmp_path / "killed"
    job.mkdir()
    export([("02_ddp", None)], job)
    agents = _agents(job, job, "--stall", "10", steps=100_000, nproc=1)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all((job / "results" / f"node{k}.jsonl").exists() for k in range(2)):
            time.sleep(0.5)   # both nodes' ranks are up and training once their node files exist
        assert all((job / "results" / f"node{k}.jsonl").exists() for k in range(2)), "the job never started"
        # Killed at once: the node files are written after the process group formed, and the ranks train
        # (100 000 steps) from there on, so the job is midway; waiting longer only burns both ranks' CPU.
        os.kill(agents[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = agents[0].wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - killed
    finally:
        _finish(agents, timeout=5)   # whatever happened, the agents' sessions end here
    text = (job / "agent0.log").read_text()
    assert code != 0 and took < 90, (code, took)
    assert "distlab: rank" in text and "(node " in text, text[-3000:]
    deadline = time.monotonic() + 30
    while _job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.5)   # the killed agent's orphans notice their peers are gone
    assert not _job_processes(job)


def test_the_rank_watchdog_is_joined_before_the_rank_exits():
    # A daemon thread left inside a store call when the interpreter finalizes is unwound through C++:
    # "terminate called without an active exception", SIGABRT after the job's work was done (seen on a
    # loaded box: rank 0 aborted, torchrun failed the job and the other node waited out its exit barrier).
    import threading

    from distlab.apps.cluster import Watchdog

    class SlowStore:
        inside = threading.Event()

        def set(self, key, value):
            self.inside.set()
            time.sleep(0.5)

        def check(self, keys):
            return False

    dog = Watchdog(SlowStore(), {"world_size": 1, "rank": 0}, stall=100, period=0.01)
    dog.start()
    assert SlowStore.inside.wait(10)
    dog.stop()
    assert not dog.is_alive()


def test_a_torchrun_rank_ends_without_finalizing_the_interpreter(tmp_path):
    # cluster.main and `python -m distlab.apps.train` end their ranks with end_rank: output flushed, the
    # exit code kept, and no interpreter shutdown (an atexit handler stands for it) while gloo may still run.
    code = ("import atexit, sys\nfrom distlab.engine.runtime import end_rank\n"
            "atexit.register(lambda: open(sys.argv[1], 'w').write('finalized'))\n"
            "print('trained', end='')\nsys.stderr.write('note')\nend_rank(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "marker")], capture_output=True, text=True,
                       timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (3, "trained", "note")
    assert not (tmp_path / "marker").exists()
