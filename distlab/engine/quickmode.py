"""Quick mode: the same cells with small sizes, for tests and CI (`DISTLAB_QUICK=1`)."""
from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")


def _quick_mode() -> bool:
    return os.environ.get("DISTLAB_QUICK", "0") not in ("", "0", "false", "False")


def quick() -> bool:
    """True when DISTLAB_QUICK=1: small models, few steps, 2-4 ranks."""
    return _quick_mode()


def pick(*, quick: T, full: T) -> T:
    """`quick` in quick mode, `full` otherwise: `steps = pick(quick=3, full=50)`."""
    return quick if _quick_mode() else full     # the keyword `quick` shadows the function here
