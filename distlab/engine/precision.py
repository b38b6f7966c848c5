"""Mixed-precision Adam: bf16 weights and gradients, fp32 master weights and moments.

PyTorch's optimizers update parameters in their own dtype, so a bf16 model
trained with `torch.optim.AdamW` keeps bf16 moments and loses small updates
to rounding. The recipe of the ZeRO paper (and of every large training run)
keeps, per parameter:

    bf16 param 2 B + bf16 grad 2 B  (what forward and backward use)
    fp32 master 4 B + fp32 m 4 B + fp32 v 4 B   (optimizer state, K = 12)

`MixedPrecisionAdam` is that optimizer: the model stays in bf16, and the
optimizer owns the fp32 copies. Each `step()` upcasts the bf16 gradient,
runs AdamW on the fp32 master and copies the master back into the bf16
parameter. So `distlab.meters.model_state(model, optimizer=opt)` measures
2 + 2 + 12 = 16 bytes per parameter.

    model = build_model("small").to(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-3)
    lm_loss(model, x, y).backward(); opt.step(); opt.zero_grad()

The fp32 state is created at the first `step()` (as in torch's Adam), from
the parameter's value at that moment: wrap the model for data parallelism
(which broadcasts rank 0's weights) before the first step, and every rank's
masters start equal. The update is the same arithmetic as
`torch.optim.AdamW(foreach=False)`, so on fp32 parameters both agree to
rounding.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterable

import torch

# ---- which dtype the arithmetic runs in ----------------------------------------------------------
# The lessons need bf16 *storage* (2-byte weights and gradients, 16 B/param,
# bf16 traffic). They do not need bf16 *arithmetic* on a CPU that emulates it:
# without AVX-512 BF16 or AMX a bf16 matmul is ~50x slower than fp32 (measured:
# 512x512 on one thread, 193 ms vs 4.1 ms). So the course picks the compute
# dtype here, once: bf16 where the device has it natively, fp32 otherwise.

_LOW = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _cpu_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _in_rank() -> bool:
    from distlab.engine.runtime import backend
    return backend() != "none"


def _default_device() -> torch.device:
    """The rank's device on a rank; outside one (a notebook's kernel), the device this machine's ranks
    compute on: its first GPU if it has one (asking the host CPU there would pick the GPU's dtype wrong).
    `torch.cuda.is_available()` counts devices without opening a CUDA context."""
    from distlab.engine.runtime import device as rank_device
    if _in_rank():
        return rank_device()
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# Run in a child process: it opens a CUDA context on the GPU asked about, and exits.
_PROBE = (
    "import json, sys, torch\n"
    "i = int(sys.argv[1])\n"
    "p = torch.cuda.get_device_properties(i)\n"
    "print(json.dumps({'name': p.name, 'major': p.major, 'minor': p.minor, 'hip': bool(torch.version.hip)}))\n"
)


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> dict[str, Any]:
    """GPU `index`'s name and compute capability, asked in a subprocess: a notebook's kernel never opens
    a CUDA context (a few hundred MiB on that GPU for the whole session) and stays fork-safe."""
    import json
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(index)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        raise RuntimeError(f"could not ask GPU {index} for its compute capability in a subprocess ({exc}); "
                           "set DISTLAB_NATIVE_BF16=1 (Ampere or newer) or 0 to say it yourself") from None


def gpu_facts(device: torch.device) -> dict[str, Any]:
    """{'name', 'major', 'minor', 'hip'} of the GPU `device`: read in this process on a rank (which
    already holds a context on its own GPU; reading another GPU's properties opens none) or where CUDA
    is initialised already, in a subprocess elsewhere (a notebook's kernel)."""
    here = _in_rank() or torch.cuda.is_initialized()      # a context exists already: no cost to read
    index = device.index if device.index is not None else (torch.cuda.current_device() if here else 0)
    if here:
        p = torch.cuda.get_device_properties(index)
        return {"name": p.name, "major": p.major, "minor": p.minor, "hip": bool(torch.version.hip)}
    return _probe(index)


def _cuda_native_bf16(device: torch.device) -> bool:
    """bf16 in hardware on the GPU `device` itself (compute capability 8.0+, Ampere on; ROCm GPUs as
    torch counts them), not emulated: a box may mix GPU models, so the device asked is the one read."""
    facts = gpu_facts(device)
    return bool(facts["hip"]) or int(facts["major"]) >= 8


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Does `device` (default: the rank's) compute in bf16 at full speed?

    GPUs: compute capability 8.0 or more, read from that GPU (`torch.cuda.is_bf16_supported()`
    counts pre-Ampere GPUs, which emulate bf16 far slower, as supported, and reads only the current
    device); outside a rank it is asked in a subprocess (see `gpu_facts`). CPUs: oneDNN's bf16 support
    (AVX-512 BF16 or AMX). $DISTLAB_NATIVE_BF16=0 or 1 overrides the answer
    (tests force the fallback with it).
    """
    forced = os.environ.get("DISTLAB_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    device = _default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        return _cuda_native_bf16(device)
    return _cpu_native_bf16()


def compute_dtype(storage_dtype: torch.dtype, device: torch.device | str | None = None) -> torch.dtype:
    """The dtype to compute in for weights stored as `storage_dtype` on `device`.

    bf16/fp16 storage computes in that dtype where the device has it
    natively, else in fp32 (the bytes stored and sent stay 2 per element).
    Other dtypes compute as stored.
    """
    if storage_dtype in _LOW and not native_bf16(device):
        return torch.float32
    return storage_dtype


def describe(device: torch.device | str | None = None) -> str:
    """One line for a notebook: what bf16 storage computes in here, and why."""
    device = _default_device() if device is None else torch.device(device)
    where = gpu_facts(device)["name"] if device.type == "cuda" else (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()})")
    if native_bf16(device):
        return f"bf16 weights compute in bf16: {where} has native bf16 arithmetic."
    return (f"bf16 weights compute in fp32: {where} has no native bf16 arithmetic (it would be emulated, "
            "~50x slower). Bytes stored and sent stay those of bf16.")


def bf16_speed_ratio(n: int = 512, repeats: int = 3) -> float:
    """bf16 matmul time / fp32 matmul time for an n x n product on one CPU thread (> 1: bf16 is slower)."""
    import time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(n, n).to(dtype)
            (a @ a)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                (a @ a)
                best = min(best, time.perf_counter() - start)
            times[dtype] = best
        return times[torch.bfloat16] / times[torch.float32]
    finally:
        torch.set_num_threads(threads)


class MixedPrecisionAdam(torch.optim.Optimizer):
    """AdamW on fp32 master copies of (typically bf16) parameters.

    State per parameter `p` (all fp32, shaped like `p`): `master`, `exp_avg`
    (m), `exp_avg_sq` (v); plus `step`, a Python int (no tensor bytes).
    Changes `p` in place (bf16 <- fp32 master) at each `step()`; reads
    `p.grad` and skips parameters whose grad is None.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 master_dtype: torch.dtype = torch.float32) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_dtype = master_dtype

    def _state_for(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            master = p.detach().to(self.master_dtype, copy=True)
            state["master"] = master
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"] = 0
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._state_for(p)
                master, m, v = st["master"], st["exp_avg"], st["exp_avg_sq"]
                g = p.grad.to(self.master_dtype)  # bf16 -> fp32: a temporary of 4 B/param
                st["step"] += 1
                t = st["step"]
                master.mul_(1 - lr * wd)  # decoupled weight decay (AdamW)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = lr / (1 - beta1 ** t)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
                master.addcdiv_(m, denom, value=-step_size)
                p.copy_(master)  # fp32 -> bf16, rounded to nearest
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but keep the fp32 state fp32 (torch casts it to the bf16 param dtype)."""
        fp32 = {idx: {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
                for idx, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, tensors in fp32.items():
            p = params[ids.index(idx)]
            for k, v in tensors.items():
                self.state[p][k] = v.to(device=p.device, dtype=self.master_dtype, copy=True)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master copies created so far, in parameter order."""
        return [self.state[p]["master"] for g in self.param_groups for p in g["params"] if p in self.state]
