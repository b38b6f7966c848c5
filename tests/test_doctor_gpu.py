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
    assert {"notebooks/01_collectives.ipynb", "notebooks/03_zero1.ipynb", "notebooks/05_zero3.ipynb"} <= set(books)
    assert books.index("notebooks/01_collectives.ipynb") < books.index("solutions/01_collectives.ipynb") \
        < books.index("notebooks/02_ddp.ipynb")


def test_each_result_goes_to_its_own_notebook(tmp_path):
    # What nbval's junit file holds: the path with dots. Names overlap on purpose.
    results = [("solutions.08_pipeline.ipynb::Cell 3", "failed"), ("notebooks.08_pipeline_3d.ipynb::Cell 1", "passed"),
               ("notebooks.02_ddp.ipynb::Cell 0", "passed"), ("solutions.02_ddp.ipynb::Cell 0", "failed")]
    assert results_of(ROOT / "notebooks/08_pipeline_3d.ipynb", ROOT, results) == ["passed"]
    assert results_of(ROOT / "solutions/08_pipeline.ipynb", ROOT, results) == ["failed"]
    assert results_of(ROOT / "notebooks/02_ddp.ipynb", ROOT, results) == ["passed"]
    assert results_of(ROOT / "notebooks/05_zero3.ipynb", ROOT, results) == []      # "did not run"


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
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    start = time.monotonic()
    code, results = _pytest(["-p", "no:distlab", "-o", "addopts=", str(tmp_path / "test_hang.py")], env,
                            tmp_path / "out.xml", timeout=8, cwd=tmp_path)
    assert code == -1 and time.monotonic() - start < 60
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "out.log").exists()
