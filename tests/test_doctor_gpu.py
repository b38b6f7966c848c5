"""`distlab doctor --gpu`'s bookkeeping, on CPU: which notebooks it runs, whose result is whose, and a
timeout that leaves nothing running (the GPU run itself needs a GPU: tests/test_gpu.py)."""
import os
import textwrap
import time
from pathlib import Path

import psutil

from distlab.apps.doctor.gpu import _notebooks, _pytest, results_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_lecture_and_every_solution_is_checked():
    books = [str(p.relative_to(ROOT)) for p in _notebooks(ROOT)]
    expected = sorted(str(p.relative_to(ROOT)) for d in ("notebooks", "solutions") for p in (ROOT / d).glob("*.ipynb"))
    assert sorted(books) == expected
    assert {"notebooks/01_collectives_lecture.ipynb", "notebooks/03_zero1_lecture.ipynb", "notebooks/05_zero3_lecture.ipynb"} <= set(books)
    assert books.index("notebooks/01_collectives_lecture.ipynb") < books.index("solutions/01_collectives.ipynb") \
        < books.index("notebooks/02_ddp_lecture.ipynb")


def test_each_result_goes_to_its_own_notebook(tmp_path):
    # What nbval's junit file holds: the path with dots. Names overlap on purpose.
    results = [("solutions.08_pipeline.ipynb::Cell 3", "failed"), ("notebooks.08_pipeline_3d_lecture.ipynb::Cell 1", "passed"),
               ("notebooks.02_ddp_lecture.ipynb::Cell 0", "passed"), ("solutions.02_ddp.ipynb::Cell 0", "failed")]
    assert results_of(ROOT / "notebooks/08_pipeline_3d_lecture.ipynb", ROOT, results) == ["passed"]
    assert results_of(ROOT / "solutions/08_pipeline.ipynb", ROOT, results) == ["failed"]
    assert results_of(ROOT / "notebooks/02_ddp_lecture.ipynb", ROOT, results) == ["passed"]
    assert results_of(ROOT / "notebooks/05_zero3_lecture.ipynb", ROOT, results) == []      # "did not run"


def test_a_timeout_ends_pytest_and_everything_it_started(tmp_path):
    # A test that starts a process in a session of its own (as jupyter_client starts kernels) and hangs.
    pidfile = tmp_path / "child.pid"
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        def test_hangs():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(child.pid))
            time.sleep(600)
        """))
    # No plugin autoload: pytest reaches the test in well under a second (0.4 s at a load of 9 on 2 cores).
    # Should the timeout still fire before the test started its child (no pid yet), the run is repeated
    # with twice the timeout: a loaded machine makes this test slower, never wrong.
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    for timeout in (3, 6, 12, 24):
        start = time.monotonic()
        code, results = _pytest(["-p", "xdist.plugin", "-p", "no:distlab", "-o", "addopts=",
                                 str(tmp_path / "test_hang.py")], env, tmp_path / "out.xml", timeout=timeout,
                                cwd=tmp_path)
        assert code == -1 and time.monotonic() - start < 60
        if pidfile.exists() and pidfile.read_text():
            break
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "out.log").exists()


def test_smoke_dry_run_lists_every_step_and_runs_the_cpu_stand_ins(capsys, no_orphans, monkeypatch):
    """`distlab doctor --gpu --smoke --dry-run` on this CPU box (issue 39): every step listed with what it
    would run on GPUs; the kernel check, the launcher's job on gloo, the hang on the strict backend and the
    GPU tests' import run here and pass."""
    from distlab.apps.doctor import smoke as smoke_mod
    from distlab.apps.doctor.smoke import smoke
    # the hang's stall window: 2 s, as the suite's other hang tests (conftest.SHORT_STALL_S), not the doctor's 3 s
    monkeypatch.setattr(smoke_mod, "HANG_STALL_S", 2.0)
    assert smoke(dry_run=True, gpus=0) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("[")]
    assert [line.split()[1] for line in steps] == ["PASS"] * 5 + ["LIST"] * 2
    text = "\n".join(steps)
    for what in ("backend='nccl'", "CUDA context in the kernel: none", "LaunchStalled after",
                 "naming the op and its line: _hang_job", "pytest -m gpu tests/test_gpu.py",
                 "tests import and are marked gpu", "--backend nccl --only reduce_scatter --first-case",
                 "notebooks/00_launching_lecture.ipynb notebooks/05_zero3_lecture.ipynb notebooks/08_pipeline_3d_lecture.ipynb"):
        assert what in text, what
    assert lines[-1].startswith("summary: 5 passed, 0 failed, 0 skipped, 2 listed only in ")
    assert lines[-1].endswith("(nothing ran on a GPU)")


def test_smoke_on_gpus_skips_what_the_box_cannot_run_and_keeps_to_its_budget(monkeypatch, capsys, tmp_path):
    """The order, the 2-GPU steps on a 1-GPU box, a failing step, and the budget (steps faked)."""
    import time as time_

    from distlab.apps.doctor import smoke as smoke_mod
    ran = []

    def step(name, gpus, ok=True, sleep=0.0):
        def run(ctx, seconds):
            ran.append((name, round(seconds)))
            time_.sleep(sleep)
            return ok, f"{name} done"
        return smoke_mod.Step(name, f"run {name}", run, cap_s=100, gpus=gpus)
    monkeypatch.setattr(smoke_mod, "steps", lambda n: [step("a", 1), step("b", 2), step("c", 1, ok=False),
                                                        step("d", 1, sleep=0.2), step("e", 1)])
    monkeypatch.setattr(smoke_mod, "_start_kernel", lambda ctx: None)
    assert smoke_mod.smoke(gpus=1, budget_s=10.15, out=tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out if line.startswith("[")] == ["PASS", "SKIP", "FAIL", "PASS", "SKIP"]
    assert "needs 2 GPUs, 1 here" in out[2] and "out of time (--budget)" in out[5]
    assert [name for name, _ in ran] == ["a", "c", "d"] and ran[0][1] == 10
    assert out[-1].startswith("summary: 2 passed, 1 failed, 2 skipped in ")
