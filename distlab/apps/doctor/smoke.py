"""`distlab doctor --gpu --smoke`: the first minutes on a GPU box, most informative check first.

For a maintainer who is lent a GPU machine for a quarter of an hour: a check that fits twice into
that time (`--budget`, 360 s by default), prints one line per check and a summary, and installs
nothing (the machine has a CUDA build of torch and no network; put the checkout on it with
`pip install -e . --no-deps`). In order:

0. the environment: a CUDA build of torch, and every module the checks import (none is installed);
1. the launcher on NCCL at N = GPU count: each rank bound to its own GPU, bf16 as that GPU has it,
   an all-reduce, the memory meter against the allocator, ranks started by forkserver (no fork of a
   CUDA parent);
2. a notebook's kernel asks for bf16 support without opening a CUDA context (issue 39, point 4; a
   fresh interpreter, started at once so that it imports torch while step 1 runs);
3. with 2 GPUs or more, a deliberate hang: rank 0 all-reduces, rank 1 never joins; it must be
   reported as `LaunchStalled` within seconds, naming the op and its line (the hang watch);
4. the GPU-marked tests (`pytest -m gpu tests/`);
5. with 2 GPUs or more, one graded ring (chapter 1's reduce-scatter, first case) on the metered NCCL
   group of `distlab grade --backend nccl`;
6. lectures 00, 05 and 08 in quick mode at N = GPU count, under `pytest --nbval-lax`.

`--dry-run` (on any machine) lists every step with what it would run, and runs the CPU stand-ins
that take seconds: the kernel check, the launcher's job on gloo, the hang on the strict backend, and
the collection of the GPU-marked tests.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

LECTURES = ("notebooks/00_launching_lecture.ipynb", "notebooks/05_zero3_lecture.ipynb", "notebooks/08_pipeline_3d_lecture.ipynb")
NEEDED = ("torch", "cloudpickle", "psutil", "pytest", "nbval", "nbclient", "nbformat", "ipykernel", "matplotlib")
HANG_STALL_S = 3.0


@dataclass
class Step:
    """One check: `run(ctx, seconds)` -> (ok, detail) on GPUs; `stand_in` the same on a CPU, if it has one."""
    name: str
    what: str                                   # the command or job it runs, for the dry run's listing
    run: Callable[[dict, float], tuple[bool, str]]
    cap_s: float
    gpus: int = 1                               # GPUs it needs
    stand_in: Callable[[dict, float], tuple[bool, str]] | None = None
    stand_in_what: str = ""


@dataclass
class Outcome:
    status: str                                 # PASS, FAIL, SKIP, LIST
    detail: str = ""
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)


# ---- 0. the environment ------------------------------------------------------------------------------

def _environment(ctx: dict, _: float) -> tuple[bool, str]:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    import torch
    cuda = torch.version.cuda or torch.version.hip
    ok = not missing and (bool(cuda) or ctx["dry"])
    text = (f"torch {torch.__version__} ({'CUDA ' + str(cuda) if cuda else 'a CPU build'}), "
            f"distlab from {Path(__file__).resolve().parents[3]}")
    if missing:
        text += (f"; missing: {', '.join(missing)} (nothing is installed here: bring them as wheels, "
                 "pip install --no-index --find-links WHEELS ..., then pip install -e . --no-deps)")
    return ok, text


# ---- 1. the kernel asks without a CUDA context ----------------------------------------------------------

_KERNEL = ("import torch\n"
           "from distlab.engine import precision\n"
           "line = precision.describe()\n"
           "dtype = precision.compute_dtype(torch.bfloat16)\n"
           "print(repr((line, str(dtype), torch.cuda.is_initialized())))\n")


def _start_kernel(ctx: dict) -> subprocess.Popen:
    """Start the kernel's check at once: a fresh interpreter imports torch (seconds), meanwhile the
    launcher's check runs."""
    return subprocess.Popen([sys.executable, "-c", _KERNEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ctx["root"], env=ctx["env"])


def _kernel(ctx: dict, seconds: float) -> tuple[bool, str]:
    """What a notebook's kernel does (no process group): precision.describe() and compute_dtype()."""
    import ast
    proc = ctx.get("kernel") or _start_kernel(ctx)
    try:
        stdout, stderr = proc.communicate(timeout=seconds)
        line, dtype, opened = ast.literal_eval(stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False, f"the kernel's check took over {seconds:.0f} s"
    except (ValueError, SyntaxError, IndexError):
        return False, f"the kernel's check failed: {(stderr.strip().splitlines() or ['no output'])[-1][:300]}"
    return not opened, (f"CUDA context in the kernel: {'OPENED' if opened else 'none'}; "
                        f"compute dtype {dtype.replace('torch.', '')}; {line}")


# ---- 2. the launcher on NCCL ------------------------------------------------------------------------------

def _launch_job() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import distlab
    from distlab.engine.precision import native_bf16
    from distlab.meters import track_memory
    dev, r, n = distlab.device(), distlab.rank(), distlab.world_size()
    t = torch.full((1024,), float(r + 1), device=dev)
    dist.all_reduce(t)
    out = {"device": str(dev), "sum_ok": bool((t == n * (n + 1) / 2).all().item()), "bf16": native_bf16(),
           "backend": distlab.backend()}
    if dev.type == "cuda":
        out["current"] = torch.cuda.current_device()
        out["gpu"] = torch.cuda.get_device_name(dev)
    with track_memory(dev) as mem:
        block = torch.empty(2 ** 20, dtype=torch.float32, device=dev)      # 4 MiB exactly
        out["meter"] = mem.current_bytes
    out["expected"] = block.numel() * block.element_size()
    out["allocator"] = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else out["meter"]
    return out


def _launcher(backend: str, n: int) -> Callable[[dict, float], tuple[bool, str]]:
    def run(ctx: dict, seconds: float) -> tuple[bool, str]:
        from distlab.engine import launch as launch_mod
        method = launch_mod._context().get_start_method()
        try:
            res = launch_mod.run_on_ranks(_launch_job, n, backend=backend, timeout=seconds)
        except Exception as exc:  # noqa: BLE001 - the line says what went wrong
            return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        want = [f"cuda:{r}" if backend == "nccl" else "cpu" for r in range(n)]
        problems = []
        if [x["device"] for x in res] != want or (backend == "nccl" and [x["current"] for x in res] != list(range(n))):
            problems.append(f"devices {[x['device'] for x in res]}, expected {want}")
        if not all(x["sum_ok"] for x in res):
            problems.append("a wrong all-reduce sum")
        if any(x["meter"] != x["expected"] or x["allocator"] < x["expected"] for x in res):
            problems.append(f"meter/allocator {[(x['meter'], x['allocator']) for x in res]} for 4 MiB")
        if method not in ("forkserver", "spawn"):
            problems.append(f"ranks start by {method}: a fork of a parent that may hold CUDA")
        bf16 = sorted({f"{x.get('gpu', 'cpu')}: {'native' if x['bf16'] else 'emulated -> fp32'}" for x in res})
        ok = not problems
        return ok, "; ".join(problems) if problems else (
            f"ranks on {', '.join(x['device'] for x in res)}; bf16 {', '.join(bf16)}; all-reduce right; meter = "
            f"{res[0]['meter']} B = allocator's 4 MiB; ranks by {method}")
    return run


# ---- 3. a deliberate hang ------------------------------------------------------------------------------

def _hang_job() -> str:
    import torch
    import torch.distributed as dist

    import distlab
    if distlab.rank() == 0:
        dist.all_reduce(torch.ones(1, device=distlab.device()))        # rank 1 never joins
    return "returned"


def _hang(backend: str, strict: bool) -> Callable[[dict, float], tuple[bool, str]]:
    def run(ctx: dict, seconds: float) -> tuple[bool, str]:
        import distlab
        from distlab.engine.launch import run_on_ranks
        start = time.monotonic()
        try:
            run_on_ranks(_hang_job, 2, backend=backend, stall=HANG_STALL_S, strict=strict, timeout=seconds)
        except distlab.LaunchStalled as err:
            took = time.monotonic() - start
            text = str(err)
            named = ("all_reduce" in text or "allreduce" in text) and "_hang_job" in text
            ok = named and err.ranks == [0] and took < HANG_STALL_S + 20
            return ok, (f"LaunchStalled after {took:.1f} s (stall window {HANG_STALL_S:g} s), "
                        f"{'naming the op and its line' if named else 'WITHOUT the op or its line'}: "
                        f"{err.where.get(0, '?')}; detail: {err.detail.get(0, '')[:160]}")
        except Exception as exc:  # noqa: BLE001
            return False, f"{type(exc).__name__} instead of LaunchStalled: {str(exc).splitlines()[0][:300]}"
        return False, "the launch returned: the hang was not seen"
    return run


# ---- 4.-6. pytest runs: GPU tests, the graded ring, lectures ---------------------------------------

def _gpu_tests(ctx: dict, seconds: float) -> tuple[bool, str]:
    from distlab.apps.doctor.gpu import _pytest
    code, tests = _pytest(["-m", "gpu", "tests/test_gpu.py"], ctx["env"], ctx["out"] / "gpu-tests.xml",
                          timeout=seconds, cwd=ctx["root"])
    ran = [t for t, s in tests if s != "skipped"]
    failed = [t.split("::")[-1] for t, s in tests if s == "failed"]
    if code == -1:
        return False, f"timed out after {seconds:.0f} s ({len(ran)} finished)"
    return code == 0 and bool(ran), f"{len(ran) - len(failed)}/{len(ran)} passed" + (
        f"; failed: {', '.join(failed)}" if failed else "")


def _collect_gpu_tests(ctx: dict, seconds: float) -> tuple[bool, str]:
    """The GPU tests' module imports here and marks its tests `gpu` (their rank functions run on CPU
    ranks in tests/test_gpu_on_cpu.py)."""
    import importlib.util as iu
    spec = iu.spec_from_file_location("distlab_smoke_test_gpu", ctx["root"] / "tests" / "test_gpu.py")
    module = iu.module_from_spec(spec)
    sys.path.insert(0, str(ctx["root"] / "tests"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ctx["root"] / "tests"))
    marks = {m.name for m in getattr(module, "pytestmark", [])}
    tests = sorted(n for n in vars(module) if n.startswith("test_"))
    return "gpu" in marks and bool(tests), f"{len(tests)} tests import and are marked gpu (they need CUDA to run)"


def _grade_command(root: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "distlab.apps.cli", "grade", "01_collectives",
           str(root / "solutions" / "01_collectives.ipynb"), "--backend", "nccl", "--only", "reduce_scatter",
           "--first-case", "--out", str(out)]
    import shutil
    return cmd + ([] if shutil.which("bwrap") else ["--no-sandbox"])    # our own solution: trusted


def _ring(ctx: dict, seconds: float) -> tuple[bool, str]:
    cmd = _grade_command(ctx["root"], ctx["out"] / "grades")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, cwd=ctx["root"], env=ctx["env"])
    except subprocess.TimeoutExpired:
        return False, f"timed out after {seconds:.0f} s"
    (ctx["out"] / "grade.log").write_text(out.stdout + out.stderr)
    said = [line for line in out.stdout.splitlines() if "01_collectives.ipynb:" in line]
    detail = (said or out.stdout.strip().splitlines() or out.stderr.strip().splitlines() or ["no output"])[-1]
    return out.returncode == 0 and bool(said), detail[:300]


def _lectures(ctx: dict, seconds: float) -> tuple[bool, str]:
    from distlab.apps.doctor.gpu import _pytest, results_of
    books = [ctx["root"] / b for b in LECTURES]
    code, cells = _pytest(["--nbval-lax", *map(str, books)], ctx["env"], ctx["out"] / "lectures.xml",
                          timeout=seconds, cwd=ctx["root"])
    parts = []
    ok = code == 0
    for book in books:
        mine = results_of(book, ctx["root"], cells)
        bad = mine.count("failed")
        ok = ok and bool(mine) and not bad
        parts.append(f"{book.name[:2]}: " + (f"{bad} of {len(mine)} cells failed" if bad else
                                             f"{len(mine)} cells" if mine else "did not run"))
    return ok, ("timed out; " if code == -1 else "") + ", ".join(parts)


def steps(n: int) -> list[Step]:
    """The check's steps for a machine with `n` GPUs, in the order they run."""
    n_ = str(n) if n else "N"
    return [
        Step("environment", "import checks only (installs nothing)", _environment, 30, gpus=0),
        Step(f"launcher on NCCL x{n_}", f"run_on_ranks(job, {n_}, backend='nccl'): binding, bf16, all-reduce, meter",
             _launcher("nccl", n), 120, gpus=1, stand_in=_launcher("gloo", 2), stand_in_what="the same job on gloo x2"),
        Step("kernel asks bf16 without a CUDA context", "python -c 'precision.describe(); compute_dtype(bf16)'",
             _kernel, 60, gpus=0),
        Step("a deliberate hang, reported in seconds", f"rank 0 all-reduces, rank 1 never joins; stall={HANG_STALL_S:g}",
             _hang("nccl", False), 60, gpus=2, stand_in=_hang("gloo", True),
             stand_in_what="the same job on the strict backend x2"),
        Step("GPU-marked tests", "pytest -m gpu tests/test_gpu.py", _gpu_tests, 180, gpus=1,
             stand_in=_collect_gpu_tests, stand_in_what="the module imported, its marks read"),
        Step("one graded ring on the metered NCCL group",
             "distlab grade 01_collectives solutions/01_collectives.ipynb --backend nccl --only reduce_scatter "
             "--first-case", _ring, 90, gpus=2),
        Step("lectures 00, 05, 08 in quick mode", f"DISTLAB_QUICK=1 DISTLAB_WORLD_SIZE={n_} pytest --nbval-lax {' '.join(LECTURES)}",
             _lectures, 240, gpus=1),
    ]


def smoke(*, dry_run: bool = False, budget_s: float = 360.0, root: Path | None = None,
          out: Path | None = None, gpus: int | None = None) -> int:
    """Run (or, dry, list and stand in for) the steps; print one line each and a summary; exit status."""
    from distlab.apps.tour import repo_root
    root = root or repo_root()
    if root is None:
        print("distlab doctor --gpu --smoke needs the course checkout (notebooks/ and tests/): run it from a clone.")
        return 2
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not dry_run:
        print("distlab doctor --gpu --smoke: no CUDA GPU is visible to torch here. `--dry-run` lists the steps "
              "and runs their CPU stand-ins.")
        return 2
    out = Path(out or tempfile.mkdtemp(prefix="distlab-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DISTLAB_QUICK="1", DISTLAB_WORLD_SIZE=str(max(gpus, 1)), MPLBACKEND="Agg",
               DISTLAB_RESULTS=str(out / "results"), PYTHONPATH=os.pathsep.join(
                   filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))
    if gpus:
        env.pop("DISTLAB_DEVICE_AUDIT", None)      # the GPU enforces the rule itself
    ctx: dict[str, Any] = {"root": root, "out": out, "env": env, "dry": dry_run}
    ctx["kernel"] = _start_kernel(ctx)
    plan = steps(gpus)
    head = "dry run: every step, and the CPU stand-ins that run here" if dry_run else f"budget {budget_s:.0f} s"
    print(f"distlab doctor --gpu --smoke: {gpus} GPU(s); {head}; logs in {out}", flush=True)
    start = time.monotonic()
    results = []
    for i, step in enumerate(plan, 1):
        left = budget_s - (time.monotonic() - start)
        run, prefix = step.run, ""
        if dry_run and step.gpus:           # a GPU step: listed, and its CPU stand-in run if it has one
            run, prefix = step.stand_in, f"would run: {step.what}"
        elif step.gpus > gpus:
            run, prefix = None, f"needs {step.gpus} GPUs, {gpus} here"
        took = 0.0
        if run is None:
            status, detail = ("LIST" if dry_run else "SKIP"), prefix
        elif left < 10:
            status, detail = "SKIP", "out of time (--budget)"
        else:
            t0 = time.monotonic()
            try:
                ok, detail = run(ctx, min(step.cap_s, left))
            except Exception as exc:  # noqa: BLE001 - one line, then the next check
                ok, detail = False, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            took, status = time.monotonic() - t0, "PASS" if ok else "FAIL"
            if prefix:
                detail = f"{prefix} | here: {step.stand_in_what}: {detail}"
        results.append(status)
        print(f"[{i}/{len(plan)}] {status:4} {step.name}" + (f" ({took:.1f} s)" if took else "") + f": {detail}",
              flush=True)
    counts = {s: results.count(s) for s in ("PASS", "FAIL", "SKIP", "LIST")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
          + (f", {counts['LIST']} listed only" if dry_run else "")
          + f" in {time.monotonic() - start:.0f} s" + (" (nothing ran on a GPU)" if dry_run or not gpus else ""))
    return 1 if counts["FAIL"] else 0
