"""How much a low-precision gradient reduction loses: the model chapter 3 draws beside its measurement.

A reduction of N fp32 gradients in a reduce dtype of unit roundoff u (bf16: u = 2^-8; fp32: 2^-24)
rounds twice over: each rank's gradient when it is cast to the reduce dtype (N roundings, none when the
reduce dtype is the gradients' own), and each partial sum as it is formed (a ring: partial sums of
2, 3, ..., N terms, N-1 roundings per element). Round-to-nearest leaves a relative error uniform in
±u/m for a value with mantissa m in [1, 2); for mantissas spread as real data spread them (log-uniform),
E[(error/value)^2] = u^2 E[1/m^2] / 3 = u^2 (3/8) / (3 ln 2), c = sqrt(1 / (8 ln 2)) ≈ 0.42 per
rounding in RMS.

For independent zero-mean gradients of equal spread σ, a partial sum of k terms has RMS √k·σ, the exact
sum √N·σ, and independent roundings add in variance:

    RMS relative error ≈ c·u·sqrt((N_cast + Σ_{k=2..N} k) / N) = c·u·sqrt((N_cast + N(N+1)/2 - 1) / N)

which grows like c·u·sqrt(N/2): √N, not N. The worst case (every gradient of one sign, every rounding
the same way) is the classical bound |error| ≤ ((N-1) + cast)·u·Σ|g|: N·u relative to the sum.
"""
from __future__ import annotations

import math

import torch

RMS_ROUNDING = math.sqrt(1 / (8 * math.log(2)))     # c: RMS relative error of one rounding, in units of u


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the spacing of the dtype's numbers at 1 (bf16 2^-8, fp16 2^-11, fp32 2^-24)."""
    return torch.finfo(dtype).eps / 2         # eps: the spacing at 1


def reduction_error_rms(n: int, reduce_dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32) -> float:
    """Expected ||reduced - exact|| / ||exact|| of a ring reduction of n independent zero-mean gradients
    of `grad_dtype`, cast to and summed in `reduce_dtype` (the module's docstring derives it)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    casts = n if reduce_dtype != grad_dtype else 0
    roundings = casts + n * (n + 1) // 2 - 1
    return RMS_ROUNDING * unit_roundoff(reduce_dtype) * math.sqrt(roundings / n)


def reduction_error_bound(n: int, reduce_dtype: torch.dtype, grad_dtype: torch.dtype = torch.float32) -> float:
    """The worst case, relative to the sum of gradients of one sign: ((n-1) + cast)·u."""
    return ((n - 1) + (reduce_dtype != grad_dtype)) * unit_roundoff(reduce_dtype)
