"""`distlab doctor`: what this machine can run, and (with --run) proof that it runs.

The check a learner runs first on a new workstation or laptop:

    distlab doctor          # backends, GPUs, world sizes, CPU capability and bf16 speed
    distlab doctor --run    # + a short job on every usable backend
    distlab doctor --gpu    # the whole course on this machine's GPUs (see distlab.gpucheck)
"""
from __future__ import annotations

import os
import platform
from typing import Any

import torch
import torch.distributed as dist


def machine() -> dict[str, Any]:
    """Backend, devices and versions: the `machine` record of every summary."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = None
    if gpus and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "backend": "nccl" if gpus and nccl else "gloo",
        "device_kind": torch.cuda.get_device_name(0) if gpus else "cpu",
        "device_count": gpus if gpus else 1,
        "gpu_count": gpus,
        "nccl_version": nccl,
        "gloo_available": dist.is_gloo_available(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": _cpu_native_bf16(),
    }


def _cpu_native_bf16() -> bool:
    from distlab.precision import _cpu_native_bf16 as native
    return native()


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
    from distlab.runtime import device, rank, world_size
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
    from distlab.launch import launch
    problems = []
    plans = []
    if info["gpu_count"] and info["nccl_version"]:
        plans.append(("nccl", info["gpu_count"]))
    if info["gloo_available"]:
        plans.append(("gloo", 2))
    for backend, n in plans:
        try:
            results = launch(_all_reduce_job, n, backend=backend, timeout=120)
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
    return problems


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
    from distlab.precision import bf16_speed_ratio, compute_dtype
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


def add_parser(sub):
    d = sub.add_parser("doctor", help="what this machine can run (backend, GPUs, bf16, world sizes)")
    d.add_argument("--run", action="store_true", help="also launch a short job on every usable backend")
    d.add_argument("--gpu", action="store_true",
                   help="check the whole course on this machine's GPUs: NCCL, GPU tests, every chapter (minutes)")
    return d


def run(args) -> int:
    if args.gpu:
        from distlab.gpucheck import gpu_check
        return gpu_check()
    return doctor(run=args.run)
