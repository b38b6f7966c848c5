"""How long the test suite takes on this machine, and how busy the machine was meanwhile.

    .venv/bin/python tools/suite_time.py                 # the whole suite, as README's test command runs it
    .venv/bin/python tools/suite_time.py --chapters 0-6  # the suite of chapters 0-6 only
    .venv/bin/python tools/suite_time.py --chapters 0-6 --print-command

It runs `DISTLAB_QUICK=1 python -m pytest --nbval-lax` (plus what it is given after `--`) and prints
the wall time, the CPU the whole machine spent meanwhile (from /proc/stat, so the kernels, ranks
and grading sandboxes the suite starts are counted) and the idle share, then `import torch`'s CPU
time three times, a probe of how fast this host runs right now. A shared host drifts by ~10% within
an hour: compare two revisions only in back-to-back runs (check each out in turn), not across days.

`--chapters 0-6` drops what belongs to later chapters (their notebooks, solutions and test
files, and their labs' grading by `-k`) and the cluster path (tests/test_cluster.py: leaving one
machine came after chapter 8), which is the suite the "6 minutes for chapters 0-6" target is about.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_PATH = ("tests/test_cluster.py",)


def _chapter(name: str) -> int | None:
    """The chapter a notebook or test file belongs to (None: no chapter of its own)."""
    m = re.match(r"(\d\d)_", name) or re.match(r"test_ch(\d\d)_", name)
    return int(m.group(1)) if m else None


def selection(last_chapter: int | None) -> list[str]:
    """pytest arguments that leave out every chapter after `last_chapter` (and the cluster path)."""
    if last_chapter is None:
        return []
    args = []
    for folder, pattern in (("notebooks", "*.ipynb"), ("solutions", "*.ipynb"), ("tests", "test_ch*.py")):
        for p in sorted((ROOT / folder).glob(pattern)):
            ch = _chapter(p.name)
            if ch is not None and ch > last_chapter:
                args += ["--ignore", str(p.relative_to(ROOT))]
    for p in CLUSTER_PATH:
        args += ["--ignore", p]
    later = sorted({p.stem for p in (ROOT / "labs").glob("*.ipynb") if (_chapter(p.name) or 0) > last_chapter})
    if later:   # the grading tests are parametrised by lab: their later labs, by name
        args += ["-k", " and ".join(f"not {stem}" for stem in later)]
    return args


def _busy_idle() -> tuple[float, float]:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, idle / hz


def _import_torch_cpu() -> float:
    code = "import time; t = time.process_time(); import torch; print(time.process_time() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chapters", help="e.g. 0-6: only the suite of these chapters")
    ap.add_argument("--print-command", action="store_true", help="print the pytest command and exit")
    ap.add_argument("--log", type=Path, default=Path("suite_time.log"), help="pytest's output (default: %(default)s)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    last = None
    if args.chapters:
        m = re.fullmatch(r"0*(\d+)-0*(\d+)", args.chapters)
        if not m or int(m.group(1)) != 0:
            ap.error("--chapters takes a range from chapter 0, such as 0-6")
        last = int(m.group(2))
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "-q", *selection(last), *args.pytest_args]
    if args.print_command:
        print("DISTLAB_QUICK=1 " + shlex.join(cmd))
        return 0
    env = dict(os.environ, DISTLAB_QUICK="1")
    busy0, idle0 = _busy_idle()
    start = time.monotonic()
    with open(args.log, "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    busy1, idle1 = _busy_idle()
    busy, idle = busy1 - busy0, idle1 - idle0
    summary = args.log.read_text().strip().splitlines()[-1:] or [""]
    print(f"pytest exit code {code}: {summary[0]}")
    print(f"wall {wall:.1f} s ({int(wall // 60)} min {wall % 60:04.1f} s); machine busy {busy:.0f} CPU s, "
          f"idle {100 * idle / (busy + idle):.1f}% of {os.cpu_count()} CPUs")
    probes = [_import_torch_cpu() for _ in range(3)]
    print(f"host speed now: import torch took {statistics.median(probes):.2f} s of CPU "
          f"(median of {', '.join(f'{p:.2f}' for p in probes)})")
    return code


if __name__ == "__main__":
    sys.exit(main())
