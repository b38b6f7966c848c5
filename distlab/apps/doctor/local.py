"""`distlab doctor`: what this machine can run, and (with --run) proof that it runs.

The check a learner runs first on a new workstation or laptop:

    distlab doctor          # backends, GPUs, world sizes, CPU capability and bf16 speed
    distlab doctor --run    # + a short job on every usable backend
    distlab doctor --gpu    # the whole course on this machine's GPUs (see distlab.apps.doctor.gpu)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distlab.engine.machine import machine


def world_sizes(info: dict[str, Any]) -> dict[str, list[int]]:
    """World sizes each backend can run here (gloo: up to 2 ranks per core, at most 8)."""
    out: dict[str, list[int]] = {}
    if info["gpu_count"] and info["nccl_version"]:
        out["nccl"] = list(range(1, info["gpu_count"] + 1))
    if info["gloo_available"]:
        out["gloo"] = list(range(1, min(8, 2 * (info["cpu_count"] or 1)) + 1))
    return out


def _all_reduce_job() -> dict[str, Any]:
    """Each rank contributes rank+1; every rank must end with N(N+1)/2. On CUDA,
    the memory meter must agree with the allocator on a known allocation."""
    from distlab.meters import track_memory
    from distlab.engine.runtime import device, rank, world_size
    dev, n = device(), world_size()
    t = torch.full((1024,), float(rank() + 1), device=dev)
    dist.all_reduce(t)
    ok = bool((t == n * (n + 1) / 2).all().item())
    out: dict[str, Any] = {"ok": ok, "device": str(dev)}
    with track_memory(dev) as mem:
        block = torch.empty(2 ** 20, dtype=torch.float32, device=dev)  # 4 MiB exactly
        out["meter_bytes"] = mem.current_bytes
    out["expected_bytes"] = block.numel() * block.element_size()
    if dev.type == "cuda":
        out["allocator_bytes"] = torch.cuda.memory_allocated(dev)
    return out


def run_checks(info: dict[str, Any]) -> list[str]:
    """Launch a short job on every usable backend; return problems (empty = healthy)."""
    from distlab.engine.launch import run_on_ranks
    problems = []
    plans = []
    if info["gpu_count"] and info["nccl_version"]:
        plans.append(("nccl", info["gpu_count"]))
    if info["gloo_available"]:
        plans.append(("gloo", 2))
    for backend, n in plans:
        try:
            results = run_on_ranks(_all_reduce_job, n, backend=backend, timeout=120)
        except Exception as exc:  # noqa: BLE001 - report, do not crash the doctor
            problems.append(f"{backend} x{n}: {str(exc).splitlines()[0]}")
            continue
        bad = [r for r, res in enumerate(results) if not res["ok"]]
        if bad:
            problems.append(f"{backend} x{n}: all-reduce gave a wrong sum on ranks {bad}")
        meter_off = [r for r, res in enumerate(results) if res["meter_bytes"] != res["expected_bytes"]]
        if meter_off:
            problems.append(f"{backend} x{n}: memory meter disagrees on ranks {meter_off}: {results[meter_off[0]]}")
        print(f"  {backend} x{n}: all-reduce {'ok' if not bad else 'WRONG'}; memory meter "
              f"{results[0]['meter_bytes']} B for a {results[0]['expected_bytes']} B tensor"
              + (f" (CUDA allocator holds {results[0]['allocator_bytes']} B)" if "allocator_bytes" in results[0] else ""))
    if info["gloo_available"]:
        dtensor_features()
    return problems


def dtensor_features(n: int = 4) -> None:
    """Print what DTensor and the parallel styles do on gloo (CPU ranks): a finding per feature, not a problem."""
    from distlab.apps.doctor.dtensor import probe
    from distlab.engine.launch import run_on_ranks
    print(f"DTensor features on gloo x{n} (chapter 7; a feature that fails here is a fact about this torch build):")
    for name, (ok, detail) in run_on_ranks(probe, n, backend="gloo", timeout=180)[0].items():
        print(f"  {'works' if ok else 'FAILS'}  {name}: {detail}")


def doctor(run: bool = False) -> int:
    """Print the report; return an exit status (0 healthy, 1 nothing can run or a check failed)."""
    info = machine()
    sizes = world_sizes(info)
    print(f"torch {info['torch_version']} (python {info['python_version']}), {info['cpu_count']} CPU cores")
    if info["gpu_count"]:
        print(f"GPUs: {info['gpu_count']} x {info['device_kind']}; NCCL {info['nccl_version'] or 'not available'}")
    else:
        print("GPUs: none visible to torch (labs run on the CPU with gloo)")
    for backend, ns in sizes.items():
        print(f"{backend}: world sizes {ns[0]}..{ns[-1]}")
    if not sizes:
        print("Nothing can run: this torch has neither NCCL with GPUs nor gloo. "
              "Install a torch build with distributed support (pip install torch).")
        return 1
    from distlab.engine.precision import bf16_speed_ratio, compute_dtype
    ratio = bf16_speed_ratio()
    native = "native bf16" if info["cpu_native_bf16"] else "no native bf16"
    print(f"CPU: {info['cpu_capability']}, {native}; a 512x512 bf16 matmul takes {ratio:.1f}x the fp32 time "
          f"(measured now, one thread)")
    dtype = str(compute_dtype(torch.bfloat16, "cpu")).replace("torch.", "")
    print(f"CPU ranks compute bf16-stored weights in {dtype}"
          + (" (bf16 arithmetic would be emulated here)" if dtype == "float32" else ""))
    if not run:
        return 0
    print("running a short job on each backend ...")
    problems = run_checks(info)
    for p in problems:
        print(f"PROBLEM {p}")
    print("healthy" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0
