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
                      f"(tolerance atol={atol:g}, rtol={rtol:g}){_factor_hint(mine_t, ref_t, atol, rtol)}")


def _factor_hint(mine: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str:
    """'; yours is 4x the reference: a sum where a mean is expected?' when mine is a whole multiple (2..64) of
    the reference, or the reference of mine; else ''. Cheap: one division."""
    m, r = mine.double().flatten(), ref.double().flatten()
    if m.numel() == 0 or not torch.isfinite(m).all() or not (r.abs() > atol).any():
        return ""
    big, small, word = (m, r, "a sum where a mean is expected?") if m.abs().sum() > r.abs().sum() else \
        (r, m, "a mean where a sum is expected, or contributions missing?")
    keep = small.abs() > atol
    if not keep.any():
        return ""
    k = (big[keep] / small[keep]).median().item()
    if not 1.5 < k < 64.5 or abs(k - round(k)) > 1e-3 or not torch.allclose(big, small * round(k), atol=atol,
                                                                              rtol=max(rtol, 1e-3)):
        return ""
    k = round(k)
    return f"; yours is {k}x the reference: {word}" if big is m else f"; yours is 1/{k} of the reference: {word}"


def expect(condition: bool, message: str) -> None:
    """Raise CheckFailed(message) unless `condition`."""
    if not condition:
        raise CheckFailed(message)


def reason(exc: BaseException, hint: str = "") -> str:
    """One line: the learner's own exception, unwrapped from a failed rank; where ranks hung or looped."""
    from distlab.engine.launch import LaunchOverran, LaunchStalled, LaunchTimeout, RankFailed
    if isinstance(exc, CheckFailed):
        return str(exc)
    if isinstance(exc, RankFailed):
        if exc.exc_type == "NotImplementedError":
            return "not implemented yet (NotImplementedError on a rank)"
        first = str(exc).splitlines()[0]
        at = _raised_at(exc.traceback)
        first = first if len(first) < 200 else first[:197] + "..."
        return first + (f" (at {at})" if at else "")
    if isinstance(exc, LaunchStalled):
        calls = getattr(exc, "calls", {})
        where = "; ".join(f"rank {r} waits in {w}" + (f", inside dist.{calls[r]}" if calls.get(r) else "")
                          for r, w in exc.where.items() if w)
        case = next((n for n in exc.notes.values() if n), "")
        text = f"hung: rank(s) {exc.ranks} waited {exc.timeout_s:g} s for each other"
        text += f" (case: {case})" if case else ""
        text += f"; {where}" if where else ""
        finished = getattr(exc, "finished", [])
        if finished:
            text += (f"; rank(s) {finished} had already returned, so what the waiting rank(s) expect from "
                     f"{'it' if len(finished) == 1 else 'them'} was never sent")
        return text + (f". {hint}" if hint else "")
    if isinstance(exc, LaunchOverran):
        where = "; ".join(f"rank {r} was at {w}" for r, w in exc.where.items() if w)
        case = next((n for n in exc.notes.values() if n), "")
        text = (f"never finished: rank(s) {exc.ranks} were still working after {exc.timeout_s:g} s of CPU time, "
                "far longer than a correct answer needs, and were stopped")
        text += f" (case: {case})" if case else ""
        text += f"; {where}" if where else ""
        return text + ". A loop that never ends? (a step counter never increased, a condition no rank changes)"
    if isinstance(exc, LaunchTimeout):
        return f"timed out: rank(s) {exc.ranks} still running after {exc.timeout_s:g} s"
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (NotImplementedError)"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _raised_at(traceback: str) -> str:
    """The learner's line a rank's traceback went through last (`cell [13], line 9: ...`), or ""."""
    import os
    from distlab.engine.launch import place
    last = ""
    for line in traceback.splitlines():
        line = line.strip()
        if not line.startswith('File "'):
            continue
        try:
            _, path, rest = line.split('"', 2)
            lineno = rest.split("line", 1)[1].split(",")[0].strip()
            fn = rest.rsplit(" in ", 1)[-1].strip()
        except (ValueError, IndexError):
            continue
        engine = (os.sep + "torch" + os.sep, os.sep + "distlab" + os.sep, os.sep + "multiprocessing" + os.sep,
                  os.sep + "site-packages" + os.sep, os.sep + "python3")
        if not any(e in path for e in engine):
            last = place(path, lineno, fn)
    return last


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
