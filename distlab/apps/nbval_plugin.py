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

Instructors grade with it too (`distlab grade` is the same engine, in one command):

    pytest --nbval-lax --distlab-grade 02_ddp handins/ [-n 2] [--junitxml grades.xml]

collects each handed-in notebook's graded check cells (taken from the shipped lab, never
from the notebook) as items named by task, `handins/alice.ipynb::reduce_scatter`. Running the
first of a notebook's items grades the whole notebook once in `distlab grade`'s sandbox
(`grade.grade_one`); each item then compares the verdict lines the grader computed for its
cell with the lab's expected lines, as nbval compares a cell's output, and the run ends with
each notebook's score. nbval itself does not collect the notebooks in this mode (learner
code never runs in pytest's kernel). `--distlab-no-sandbox` grades without bubblewrap (your
own notebooks only).

Hand-ins are data in this mode: no `conftest.py` is loaded (pytest's `--noconftest`, set
before pytest looks for any) and no file but a notebook is collected, so a `conftest.py` or
`test_*.py` handed in beside a notebook never runs in pytest's process.
"""
from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest

from distlab.engine.lazyimports import defer_rfc3987_syntax

KERNEL_STARTS = 3

defer_rfc3987_syntax()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("distlab", "distlab grading")
    group.addoption("--distlab-grade", metavar="LAB", default=None,
                    help="grade the notebooks given (hand-ins of LAB, e.g. 02_ddp) with distlab's sandboxed grader: "
                         "one item per graded check cell, compared with the lab's expected verdict lines")
    group.addoption("--distlab-only", action="append", default=None, metavar="TEXT",
                    help="with --distlab-grade: grade only the tasks or verdict lines containing TEXT (repeatable)")
    group.addoption("--distlab-no-sandbox", action="store_true",
                    help="with --distlab-grade: run the notebooks without bubblewrap (your own notebooks only)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any, parser: Any, args: list[str]) -> None:
    """Grading hand-ins: no conftest.py anywhere is imported (one in a hand-in folder would run as the
    instructor, outside the sandbox)."""
    if getattr(early_config.known_args_namespace, "distlab_grade", None):
        early_config.known_args_namespace.noconftest = True


def pytest_ignore_collect(collection_path: Any, config: Any) -> Any:
    """Grading hand-ins: only notebooks are collected (a test_*.py handed in is never imported)."""
    if config.getoption("--distlab-grade", None) and not collection_path.is_dir() \
            and collection_path.suffix != ".ipynb":
        return True
    return None


def pytest_configure(config: Any) -> None:
    import os
    # Notebooks that pytest runs record into a folder of their own, never into results/yours/, which
    # holds what the learner ran by hand (distlab.meters.records); kernels inherit this variable.
    if not os.environ.get("DISTLAB_RESULTS"):
        os.environ["DISTLAB_RESULTS"] = config._distlab_results = tempfile.mkdtemp(prefix="distlab-pytest-results-")
    if config.getoption("--distlab-grade", None):
        if not config.known_args_namespace.noconftest:
            raise pytest.UsageError("--distlab-grade: a conftest.py may have been loaded (give the option on the "
                                    "command line, not in an ini file's addopts after a conftest)")
        # the hand-ins are graded by distlab, never run in nbval's kernel
        plugin = config.pluginmanager.get_plugin("nbval")
        if plugin is not None:
            config.pluginmanager.unregister(plugin)
    try:
        import nbval.kernel
    except ImportError:
        return
    if not getattr(nbval.kernel.start_new_kernel, "distlab_retries", False):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)


def pytest_unconfigure(config: Any) -> None:
    import os
    import shutil
    made = getattr(config, "_distlab_results", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        if os.environ.get("DISTLAB_RESULTS") == made:
            del os.environ["DISTLAB_RESULTS"]


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


# ---- grading hand-ins: pytest --distlab-grade LAB handins/ ------------------------------------------------

_PREPARED: dict[str, Any] = {}


def _prepared(lab: str, only: list[str] | None) -> Any:
    """The shipped lab (its selected tasks) with its references, once per pytest process (as a class run)."""
    key = repr((lab, only))
    if key not in _PREPARED:
        from distlab.grading.grade import prepare
        _PREPARED[key] = prepare(lab, only)
    return _PREPARED[key]


def pytest_collect_file(file_path: Any, parent: Any) -> Any:
    lab = parent.config.getoption("--distlab-grade", None)
    if lab and str(file_path).endswith(".ipynb") and ".ipynb_checkpoints" not in str(file_path):
        return GradedNotebook.from_parent(parent, path=file_path, lab=lab)
    return None


def _produced(verdict: Any) -> str:
    """The line the grader gives a verdict: the task's own line when it scored, else FAIL with the reason."""
    if verdict.points == verdict.max_points and verdict.judged and not verdict.reason:
        return verdict.judged
    return f"FAIL {verdict.check}: {verdict.reason or 'failed'}"


class GradedNotebook(pytest.File):
    """A hand-in: one item per graded check cell of the shipped lab; graded once, when its first item runs."""

    def __init__(self, *, lab: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lab = lab
        self._result: Any = None

    def collect(self) -> Any:
        import nbformat

        from distlab.checks.labs import expected_lines, is_check_cell
        from distlab.grading.lab import grade_calls, load_lab, resolve_lab
        shipped = load_lab(self.lab).select(self.config.getoption("--distlab-only"))
        nb = nbformat.read(resolve_lab(self.lab), as_version=4)
        seen: set[str] = set()
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not is_check_cell(cell):
                continue
            tasks = [task for task, _ in grade_calls(cell.source)]
            lines = [line for g in shipped.graded if g.task.name in tasks for line in g.lines]
            # with --distlab-only, the expected lines of the verdicts graded
            expected = [e for e in expected_lines(cell) if any(e[5:] == n or e[5:].startswith(n + ": ")
                                                               for n in lines)]
            if lines:
                name = ", ".join(dict.fromkeys(t for t in tasks if any(g.task.name == t for g in shipped.graded)))
                name = name if name not in seen else f"{name} (cell {index})"
                seen.add(name)
                yield GradedCell.from_parent(self, name=name, expected=expected, lines=lines)

    def result(self) -> Any:
        if self._result is None:
            from distlab.grading.cli import sandbox_for
            from distlab.grading.grade import Options, grade_one
            box = sandbox_for(self.config.getoption("--distlab-no-sandbox"),
                              lambda text: warnings.warn(text, RuntimeWarning, stacklevel=2))
            lab = _prepared(self.lab, self.config.getoption("--distlab-only"))
            self._result = grade_one(lab, self.path, str(self.path), Options(sandbox=box))
        return self._result


class GradedCellFailed(Exception):
    pass


class GradedCell(pytest.Item):
    """A check cell of a hand-in: the grader's verdict lines for it against the lab's expected lines."""

    def __init__(self, *, expected: list[str], lines: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.expected, self.lines = expected, lines

    def runtest(self) -> None:
        result = self.parent.result()
        by_line = {v.check: v for v in result.verdicts}
        got = [_produced(by_line[name]) if name in by_line else f"FAIL {name}: not graded ({result.note})"
               for name in self.lines]
        points = sum(by_line[n].points for n in self.lines if n in by_line)
        most = sum(by_line[n].max_points for n in self.lines if n in by_line)
        self.user_properties += [("score", f"{points:g}/{most:g}"), ("distlab_points", (self.parent.path.name,
                                                                                     points, most))]
        if result.flags:
            self.user_properties.append(("audit", "; ".join(result.flags)))
        if got != self.expected:
            raise GradedCellFailed(got, self.expected, result.note)

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if not isinstance(excinfo.value, GradedCellFailed):
            return super().repr_failure(excinfo)
        got, expected, note = excinfo.value.args
        out = ["distlab grade: the verdicts differ from the lab's expected output"] + ([f"note: {note}"] if note
                                                                                          else [])
        for want, have in zip(expected + [""] * len(got), got + [""] * len(expected)):
            if want != have:
                out += [f"  expected: {want}", f"  got:      {have}"]
        return "\n".join(out)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"{self.parent.path.name}::{self.name}"


# ---- each notebook's score at the end of the run (from the items' reports: with -n 2 they come from workers)

_SCORES: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call":
        return
    for key, value in getattr(report, "user_properties", ()):
        if key == "distlab_points" and isinstance(value, (list, tuple)) and len(value) == 3:
            got = _SCORES.setdefault(str(value[0]), [0.0, 0.0])
            got[0] += float(value[1])
            got[1] += float(value[2])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    if not config.getoption("--distlab-grade", None) or not _SCORES:
        return
    terminalreporter.section(f"distlab grade {config.getoption('--distlab-grade')}: score per notebook")
    width = max(len(name) for name in _SCORES)
    for name, (points, most) in sorted(_SCORES.items()):
        terminalreporter.write_line(f"{name:<{width}}  {points:g}/{most:g}")
