"""Verdict lines: short, deterministic, and something a learner can act on.

A check cell (tag `nbval-check-output`) prints only these lines, so nbval
compares them with the solution's: no timings, no addresses, no raw floats.

    check("ring all-reduce, 4 ranks", lambda: compare(mine, ref))
    PASS ring all-reduce, 4 ranks: exact
    FAIL ring all-reduce, 4 ranks: max |mine - ref| = 3.2e+00 (tolerance 1e-06)
"""
from __future__ import annotations

import contextlib
import io
import sys
from typing import Any, Callable

import torch


class CheckFailed(AssertionError):
    """A graded check's condition did not hold; the message says what to fix."""


def compare(mine: Any, ref: Any, *, atol: float = 1e-6, rtol: float = 1e-5, what: str = "mine") -> str:
    """'exact' or 'close' when tensors agree; raise CheckFailed otherwise."""
    mine_t, ref_t = torch.as_tensor(mine), torch.as_tensor(ref)
    if mine_t.shape != ref_t.shape:
        raise CheckFailed(f"{what} has shape {tuple(mine_t.shape)}, expected {tuple(ref_t.shape)}")
    if mine_t.dtype != ref_t.dtype:
        raise CheckFailed(f"{what} has dtype {mine_t.dtype}, expected {ref_t.dtype}")
    if torch.equal(mine_t, ref_t):
        return "exact"
    diff = (mine_t.double() - ref_t.double()).abs()
    if torch.allclose(mine_t.double(), ref_t.double(), atol=atol, rtol=rtol, equal_nan=True):
        return "close"
    raise CheckFailed(f"max |{what} - reference| = {diff.max().item():.1e} "
                      f"(tolerance atol={atol:g}, rtol={rtol:g})")


def expect(condition: bool, message: str) -> None:
    """Raise CheckFailed(message) unless `condition`."""
    if not condition:
        raise CheckFailed(message)


def reason(exc: BaseException, hint: str = "") -> str:
    """One line: the learner's own exception, unwrapped from a failed rank; where ranks hung."""
    from distlab.engine.launch import LaunchStalled, LaunchTimeout, RankFailed
    if isinstance(exc, CheckFailed):
        return str(exc)
    if isinstance(exc, RankFailed):
        if exc.exc_type == "NotImplementedError":
            return "not implemented yet (NotImplementedError on a rank)"
        first = str(exc).splitlines()[0]
        return first if len(first) < 200 else first[:197] + "..."
    if isinstance(exc, LaunchStalled):
        where = "; ".join(f"rank {r} waits in {w}" for r, w in exc.where.items() if w)
        case = next((n for n in exc.notes.values() if n), "")
        text = f"hung: rank(s) {exc.ranks} waited {exc.timeout_s:g} s for each other"
        text += f" (case: {case})" if case else ""
        text += f"; {where}" if where else ""
        return text + (f". {hint}" if hint else "")
    if isinstance(exc, LaunchTimeout):
        return f"timed out: rank(s) {exc.ranks} still running after {exc.timeout_s:g} s"
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (NotImplementedError)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def check(name: str, fn: Callable[[], Any]) -> bool:
    """Run one graded check and print its verdict line; True if it passed.

    `fn` returns a short detail for the PASS line (or None) and raises when
    the learner's code is wrong; every exception becomes a FAIL line.
    Whatever `fn` prints (ranks' replayed output, the launcher's notes) is held
    back, so the cell's output is the verdict alone; after a FAIL it is shown
    on stderr to help debugging.
    """
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            detail = fn()
    except Exception as exc:  # noqa: BLE001 - every failure is a verdict, never a crash
        print(f"FAIL {name}: {reason(exc)}")
        if held.getvalue().strip():
            sys.stderr.write(f"(output of the failed check '{name}')\n{held.getvalue()}")
        return False
    print(f"PASS {name}" + (f": {detail}" if detail else ""))
    return True
