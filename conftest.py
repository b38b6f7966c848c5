"""The repository's root conftest: what applies to the notebooks collected from notebooks/ and solutions/
(tests/conftest.py sets the rest: quick mode, the device audit, the order files run in)."""
from __future__ import annotations

import os

import pytest

# Every lecture and solution notebook runs on the strict backend (gloo with NCCL's semantics, see
# distlab.engine.strict), which also applies the device audit: the bugs only a GPU would show fail here.
# Set before the notebook's kernel starts (its first cell's setup), which inherits it; the tests' own
# launches choose their backend themselves. DISTLAB_NOTEBOOK_STRICT=0 runs the notebooks on plain gloo.
_OUTSIDE_NOTEBOOKS = os.environ.get("DISTLAB_STRICT")


_COURSE = {os.path.join(os.path.dirname(os.path.abspath(__file__)), d) for d in ("notebooks", "solutions")}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The course's own notebooks only: hand-ins graded through nbval (--distlab-grade) are the grader's.
    if str(item.path).endswith(".ipynb") and os.path.dirname(os.path.abspath(str(item.path))) in _COURSE:
        os.environ["DISTLAB_STRICT"] = os.environ.get("DISTLAB_NOTEBOOK_STRICT", "1")
    elif _OUTSIDE_NOTEBOOKS is None:
        os.environ.pop("DISTLAB_STRICT", None)
    else:
        os.environ["DISTLAB_STRICT"] = _OUTSIDE_NOTEBOOKS
