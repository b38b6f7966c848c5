"""A pytest plugin (loaded automatically with distlab): nbval compares a lab's check cells
with the verdicts kept in their metadata.

A lab shows no verdict before the learner works, so its graded check cells
have no outputs; the solution's verdict lines sit in
`metadata.distlab.expected` (see `distlab.checks.labs.make_lab`). nbval compares a
cell only with its stored outputs, so before the cells run this plugin gives
each such cell those lines as its stored output:

    pytest --nbval-lax labs/01_collectives.ipynb    # passes once every check prints PASS

It also starts a notebook's kernel again when it exits before it answers (at most
`KERNEL_STARTS` tries), with what the kernel wrote on stderr: nbval sends that to
/dev/null and fails every cell of the notebook. On a busy machine a kernel can lose a
port it was given to another process between the choice and its bind.

Loaded before nbval (`-p distlab`, as the project's own test suite does), it also spares
every pytest process the ~3 s that `import nbformat` spends on a grammar no notebook
uses (`distlab.engine.lazyimports`).
"""
from __future__ import annotations

import tempfile
import warnings
from typing import Any

from distlab.engine.lazyimports import defer_rfc3987_syntax

KERNEL_STARTS = 3

defer_rfc3987_syntax()


def pytest_configure(config: Any) -> None:
    try:
        import nbval.kernel
    except ImportError:
        return
    if not getattr(nbval.kernel.start_new_kernel, "distlab_retries", False):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)


def retrying(start: Any, tries: int = KERNEL_STARTS) -> Any:
    """`start` (nbval's start_new_kernel) tried up to `tries` times while the kernel dies before it
    replies; each retry warns, with the last lines the kernel wrote on stderr."""

    def start_new_kernel(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, tries + 1):
            log = tempfile.TemporaryFile()
            try:
                return start(*args, **{**kwargs, "stderr": log})
            except RuntimeError as exc:
                if "died" not in str(exc) or attempt == tries:
                    raise
                log.seek(0)
                said = log.read().decode(errors="replace").strip().splitlines()[-3:]
                # a warning: pytest lists it in its summary (a test's own stderr is shown only when it fails)
                warnings.warn(f"distlab: a notebook kernel exited before it replied (try {attempt} of {tries}); "
                              f"it said: {' | '.join(said) or 'nothing'}. Starting it again.", RuntimeWarning,
                              stacklevel=2)

    start_new_kernel.distlab_retries = True
    return start_new_kernel


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    import nbformat

    from distlab.checks.labs import expected_lines, is_check_cell
    for item in items:
        cell = getattr(item, "cell", None)
        if type(item).__name__ != "IPyNbCell" or cell is None or not hasattr(cell, "get"):
            continue
        expected = expected_lines(cell)
        if is_check_cell(cell) and expected and not cell.get("outputs"):
            cell["outputs"] = [nbformat.v4.new_output("stream", name="stdout", text="\n".join(expected) + "\n")]
            cell["execution_count"] = cell.get("execution_count") or 1
