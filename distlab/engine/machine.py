"""What this machine is: backend, devices and versions (the `machine` record of every summary).

Read by `distlab doctor`, the tour's report and the GPU check; it launches nothing.
"""
from __future__ import annotations

import os
import platform
from typing import Any

import torch
import torch.distributed as dist

from distlab.engine.precision import _cpu_native_bf16, gpu_facts


def machine() -> dict[str, Any]:
    """Backend, devices and versions: the `machine` record of every summary."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = None
    if gpus and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "backend": "nccl" if gpus and nccl else "gloo",
        "device_kind": gpu_facts(torch.device("cuda", 0))["name"] if gpus else "cpu",   # no CUDA context in a kernel
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


def machine_line() -> str:
    """One line naming the machine a notebook's outputs came from, printed by each lecture's first cell so
    that committed timings say where they were measured (they are not comparable across machines)."""
    m = machine()
    if m["gpu_count"]:
        where = f"{m['gpu_count']} x {m['device_kind']}, NCCL {m['nccl_version']}"
    else:
        bf16 = "native bf16" if m["cpu_native_bf16"] else "no native bf16"
        where = f"CPU ({m['cpu_capability']}, {bf16}), {m['cpu_count']} cores, gloo"
    return f"machine: {where}; torch {m['torch_version']}, Python {m['python_version']}"
