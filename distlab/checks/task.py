"""Graded tasks: the learner's code runs on ranks, the verdict is computed outside them.

A lab's check cell is one line:

    grade("reduce_scatter", ring_reduce_scatter)

Behind it, a task (one per graded step) is a row of its chapter's table,
`TASKS = table(task(name, answers, per_ranks(...), exercise=f, ...), ...)`
in `distlab.checks.chNN`: verdict lines and plain functions. It says:

- `cases()`: the launches that exercise the answer, each a `Case` (world
  size, arguments, and the names of the verdict lines it decides);
- `exercise(case, *answers)`: runs on every rank *with the learner's code*
  and returns raw outputs only (tensors, numbers, meter snapshots), never a
  verdict;
- `reference(case)`: what correct raw outputs look like, computed *without*
  learner code (here, or by a launch of its own), cached per process;
- optionally `inputs(case, rng)`: every rank's inputs (one dict of tensors per
  rank) drawn from `rng`. The notebook never calls it: there the task builds
  its fixed, seeded inputs itself. `distlab grade` draws them from a secret
  seed, computes `reference(case, inputs=...)` from them in the grader and
  gives each rank only its own (`exercise(case, *answers, inputs=mine)`), so
  no rank can rebuild another rank's inputs from the package;
- `judge(case, outputs, reference)`: pure; runs where verdicts are printed
  (the notebook's kernel, or the grader's own process), never on a rank.

The notebook and `distlab grade` share all of it. In the notebook `grade`
launches `exercise` with the kernel's objects; the grader runs it in a
sandbox with the learner's answer cells, validates what comes back
(`validate`) and calls the same `judge`. So a submission can make its own
ranks return anything, but cannot change how that is judged.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from distlab.checks.verdict import CheckFailed, reason

# Seconds every unfinished rank may go without work before a check's launch counts as hung.
# Check cases are small: a healthy case never leaves all ranks idle this long.
CHECK_STALL_S = 5.0

# The opposite of a hang: a case whose busiest rank keeps working (a loop whose counter never moves) is
# stopped once that rank has used LIVELOCK_FACTOR times the reference's time in CPU seconds, and never less
# than LIVELOCK_FLOOR_S: the slowest correct case here uses about 2 s of CPU per rank (chapter 2's naive
# DDP on 4 ranks). CPU time, not wall time: a loaded machine slows a rank's clock, not its work.
LIVELOCK_FLOOR_S = 6.0
LIVELOCK_FACTOR = 10.0

# The reason `verdict.reason` gives for an answer that raises NotImplementedError (a stub), and the line of
# each later case of its task, which is then not run.
NOT_WRITTEN = "not implemented yet"
SKIPPED_NOT_WRITTEN = f"{NOT_WRITTEN} (not run: an earlier case raised NotImplementedError)"


def later_cases_reason(world_size: int, why: str, stuck: str = "") -> str | None:
    """After a case failed with `why` (`stuck`: "hung", "never finished" or "ran past the cap" when it never
    ended), the line each later case of the task gets without running, or None if they still run: a hang
    would make each wait as long, a stub would say the same (`run_task` and the grader's runner follow this)."""
    if stuck:
        return f"not run: an earlier case ({world_size} ranks) {stuck}"
    if why.startswith(NOT_WRITTEN):
        return SKIPPED_NOT_WRITTEN
    return None


@dataclass(frozen=True)
class Case:
    """One launch of a task: `world_size` ranks run `exercise(case, *answers)`.

    `args` is a small picklable dict the task reads; `lines` names the verdict
    lines this case decides, in print order.
    """

    world_size: int
    lines: tuple[str, ...]
    args: dict = field(default_factory=dict)

    def __hash__(self) -> int:   # args is a dict: hash what identifies the case
        return hash((self.world_size, self.lines))


@dataclass(frozen=True)
class Line:
    """One verdict: `PASS name: detail` or `FAIL name: detail`."""

    name: str
    ok: bool
    detail: str = ""

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}" + (f": {self.detail}" if self.detail else "")


class Task:
    """One graded step of a lab. Subclasses set `name`, `answers`, and implement the four methods."""

    name: str = ""
    answers: tuple[str, ...] = ()        # the learner's names this task needs, in call order
    hang_hint: str = ""                  # what usually makes this task's answers hang
    points: float = 1.0                  # per verdict line

    def cases(self) -> list[Case]:
        raise NotImplementedError

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's inputs for `case` drawn from `rng`, one dict of CPU tensors per rank (rank r gets
        element r); None (the default): the task's inputs are fixed. Called by the grader only."""
        return None

    def exercise(self, case: Case, *answers: Any, inputs: dict[str, torch.Tensor] | None = None) -> Any:
        """On every rank, with the learner's objects: raw outputs for `judge`. `inputs`: this rank's drawn
        inputs under grading (None in the notebook: the task's fixed ones)."""
        raise NotImplementedError

    def reference(self, case: Case, inputs: list[dict[str, torch.Tensor]] | None = None) -> Any:
        """Correct raw outputs, without learner code (None when `judge` needs none); `inputs`: every rank's
        drawn inputs under grading (None: the fixed ones)."""
        return None

    def judge(self, case: Case, outputs: list[Any], reference: Any) -> list[Line]:
        """Verdicts from every rank's raw outputs; pure. Use `check_line` for each line."""
        raise NotImplementedError

    def lines(self) -> list[str]:
        return [name for case in self.cases() for name in case.lines]


_JUDGING: contextvars.ContextVar[Row | None] = contextvars.ContextVar("judging", default=None)


# ---- a chapter's tasks as a table: data and plain functions ---------------------------------------------

# eq=False: hashed by identity (references are cached per task); kw_only: Task's class attributes are defaults
@dataclass(frozen=True, eq=False, kw_only=True)
class Row(Task):
    """A row of a chapter's table (built by `task`): the `Task` protocol over plain module-level functions that
    take the case first; `inputs=` reaches exercise and reference only when drawn (fixed inputs: need not)."""

    name: str
    answers: tuple[str, ...]
    case_list: tuple[Case, ...]
    exercise_fn: Callable[..., Any]
    judge_fn: Callable[..., list[Line]]
    reference_fn: Callable[..., Any] | None = None
    inputs_fn: Callable[..., Any] | None = None
    hang_hint: str = ""
    points: float = 1.0

    def cases(self) -> list[Case]:
        return list(self.case_list)

    def inputs(self, case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]] | None:
        return None if self.inputs_fn is None else self.inputs_fn(case, rng)

    def exercise(self, case: Case, *answers: Any, inputs: dict[str, torch.Tensor] | None = None) -> Any:
        return self.exercise_fn(case, *answers) if inputs is None else self.exercise_fn(case, *answers, inputs=inputs)

    def reference(self, case: Case, inputs: list[dict[str, torch.Tensor]] | None = None) -> Any:
        if self.reference_fn is None:
            return None
        return self.reference_fn(case) if inputs is None else self.reference_fn(case, inputs=inputs)

    def judge(self, case: Case, outputs: list[Any], reference: Any) -> list[Line]:
        token = _JUDGING.set(self)        # so that `malformed` can say which answer a missing output comes from
        try:
            return self.judge_fn(case, outputs, reference)
        finally:
            _JUDGING.reset(token)


def task(name: str, answers: str | tuple[str, ...], cases: Iterable[Case], *, exercise: Callable[..., Any],
         judge: Callable[..., list[Line]], reference: Callable[..., Any] | None = None,
         inputs: Callable[..., Any] | None = None, hang_hint: str = "", points: float = 1.0) -> Row:
    """One graded step of a lab as a row of its chapter's table: the learner's names it takes (one or a tuple),
    its cases with their verdict lines (`per_ranks`), and the plain functions that run and judge them (`Row`)."""
    return Row(name=name, answers=(answers,) if isinstance(answers, str) else tuple(answers),
               case_list=tuple(cases), exercise_fn=exercise, judge_fn=judge, reference_fn=reference,
               inputs_fn=inputs, hang_hint=hang_hint, points=points)


def per_ranks(world_sizes: Iterable[int], *lines: str, args: dict | Callable[[int], dict] | None = None
              ) -> tuple[Case, ...]:
    """One case per world size n, deciding `lines` in order ("{n}" in a line stands for n); `args`: the
    cases' arguments, one dict or n -> dict."""
    return tuple(Case(n, tuple(line.replace("{n}", str(n)) for line in lines),
                      dict((args(n) if callable(args) else args) or {})) for n in world_sizes)


def table(*tasks: Task) -> dict[str, Task]:
    """A lab's `TASKS`: its tasks by name, in the lab's order."""
    out = {t.name: t for t in tasks}
    assert len(out) == len(tasks), f"two tasks share a name: {[t.name for t in tasks]}"
    return out


def check_line(name: str, fn: Callable[[], Any]) -> Line:
    """A Line from `fn()`: PASS with its return value as detail, FAIL with the reason it raised.

    Anything `fn` raises becomes a FAIL (a malformed output from a rank
    raises KeyError or TypeError here: that is a FAIL, never a crash).
    """
    try:
        detail = fn()
    except CheckFailed as exc:
        return Line(name, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - raw outputs come from learner processes
        return Line(name, False, malformed(exc))
    return Line(name, True, "" if detail is None else str(detail))


def malformed(exc: BaseException) -> str:
    """Why a rank's outputs could not be judged, naming what was missing: the key of a KeyError (an output
    the check records from your object, e.g. an attribute your class should set) and, while a `Row` judges,
    which of your answers it comes from and which function of the check records it; the message of others."""
    row = _JUDGING.get()
    yours = f"your {' / '.join(row.answers)}" if row is not None and row.answers else "your code"
    fn = getattr(row.exercise_fn, "func", row.exercise_fn) if row is not None else None     # a partial's own
    where = f" (recorded on each rank by {fn.__module__}.{fn.__name__})" if fn is not None else ""
    if isinstance(exc, KeyError) and exc.args:
        key = exc.args[0]
        return (f"malformed result from the ranks: no {key!r} in what they returned{where}: it comes from "
                f"{yours}; did {yours} set {key!r} (an attribute, or a key of what it returns) on every rank?")
    if isinstance(exc, (TypeError, AttributeError, IndexError)):
        return (f"malformed result from the ranks: {type(exc).__name__}: {str(exc)[:160]}{where} (a value from "
                f"{yours} of another type or shape than the task's docstring asks for)")
    return f"malformed result from the ranks ({type(exc).__name__}: {str(exc)[:120]})"


# ---- what may come back from a rank ---------------------------------------------------------------

_MAX_DEPTH, _MAX_ITEMS = 12, 200_000


def validate(obj: Any) -> None:
    """Raise CheckFailed unless `obj` is plain data: None, bool, int, float, str, CPU tensors,
    dtypes, meter snapshots, and lists / tuples / dicts of these (bounded depth and size)."""
    from distlab.meters import CommStats, MemoryStats, ModelState
    count = 0
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        count += 1
        if depth > _MAX_DEPTH or count > _MAX_ITEMS:
            raise CheckFailed("malformed result from the ranks (nested too deep or too large)")
        if x is None or type(x) in (bool, int, float, str, torch.dtype, torch.Size):
            continue
        if type(x) is torch.Tensor:
            if x.layout != torch.strided or x.device.type != "cpu":
                raise CheckFailed("malformed result from the ranks (a tensor that is not a plain CPU tensor)")
            continue
        if type(x) in (CommStats, MemoryStats, ModelState):
            stack += [(v, depth + 1) for v in vars(x).values()]
            continue
        if type(x) in (list, tuple):
            stack += [(v, depth + 1) for v in x]
            continue
        if type(x) is dict:
            stack += [(v, depth + 1) for kv in x.items() for v in kv]
            continue
        raise CheckFailed(f"malformed result from the ranks (a {type(x).__name__})")


# ---- running a task from a notebook ---------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _reference(task: Task, case: Case) -> tuple[Any, float]:
    start = time.monotonic()
    ref = task.reference(case)
    return ref, time.monotonic() - start


def on_one_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` computed on one rank of the launcher, not in this process. A reference that trains with
    `torch.optim` belongs there: an optimizer's first construction imports torch._dynamo (2-3 s, once per
    process), which the ranks' fork server has already paid and a notebook's kernel has not."""
    from distlab.engine.launch import launch
    return launch(fn, 1, args=args)[0]


def reference_of(task: Task, case: Case) -> Any:
    """`task.reference(case)`, computed once per process."""
    return _reference(task, case)[0]


def reference_seconds(task: Task, case: Case) -> float:
    """How long `task.reference(case)` took when this process computed it (cached, like reference_of)."""
    return _reference(task, case)[1]


def work_cap_for(reference_s: float) -> float:
    """The livelock bound of a case whose reference took `reference_s` seconds: the CPU seconds its busiest
    rank may use (`run_on_ranks(work_cap=...)`); LIVELOCK_FACTOR x the reference, at least LIVELOCK_FLOOR_S."""
    return max(LIVELOCK_FLOOR_S, LIVELOCK_FACTOR * reference_s)


def _exercise_on_rank(task: Task, case: Case, answers: tuple) -> Any:
    return task.exercise(case, *answers)


def launch_exercise(task: Task, case: Case, answers: tuple, *, stall: float | None = None,
                    work_cap: float | None = None) -> list[Any]:
    """Run `task.exercise(case, *answers)` on `case.world_size` ranks (the notebook's way);
    `stall`: the hang window, `CHECK_STALL_S` unless given; `work_cap`: the livelock bound,
    `work_cap_for` the reference's time unless given."""
    from distlab.engine.launch import run_on_ranks
    if work_cap is None:
        work_cap = work_cap_for(_reference(task, case)[1])
    return run_on_ranks(_exercise_on_rank, case.world_size, args=(task, case, tuple(answers)),
                        stall=CHECK_STALL_S if stall is None else stall, work_cap=work_cap)


def stuck_word(exc: BaseException) -> str:
    """"hung" for a deadlock, "never finished" for a livelock, "" for anything that ended."""
    from distlab.engine.launch import LaunchOverran, LaunchStalled
    return "hung" if isinstance(exc, LaunchStalled) else "never finished" if isinstance(exc, LaunchOverran) else ""


def run_task(task: Task, answers: Iterable[Any], *,
             run: Callable[[Task, Case, tuple], list[Any]] = launch_exercise) -> list[Line]:
    """Every verdict line of `task`, in order: run each case, validate its outputs, judge them.

    A case whose launch fails fails its lines with the reason. After a hang,
    or a livelock (a rank busy past the case's work cap), the remaining
    cases are not run (each waits just as long): their lines fail with "not
    run". After a NotImplementedError (an answer still to be
    written) the remaining cases are not run either: they would say the same.
    """
    answers = tuple(answers)
    out: list[Line] = []
    skip = None
    for case in task.cases():
        if skip is not None:
            out += [Line(n, False, skip) for n in case.lines]
            continue
        try:
            ref = reference_of(task, case)
            outputs = run(task, case, answers)
            validate(outputs)
        except Exception as exc:  # noqa: BLE001 - every failure is a verdict
            why = reason(exc, task.hang_hint)
            skip = later_cases_reason(case.world_size, why, stuck_word(exc))
            out += [Line(n, False, why) for n in case.lines]
            continue
        try:
            lines = {line.name: line for line in task.judge(case, outputs, ref)}
        except Exception as exc:  # noqa: BLE001 - a malformed output must not crash the verdict
            lines = {n: Line(n, False, malformed(exc)) for n in case.lines}
        out += [lines.get(n, Line(n, False, "no verdict (malformed result)")) for n in case.lines]
    return out


def grade_task(task: Task, *answers: Any) -> list[Line]:
    """Run a task and print its verdicts (`verdict_text`), and nothing else: ranks' output is held back
    and shown on stderr only when a line fails. Returns the lines."""
    held = io.StringIO()
    with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
        lines = run_task(task, answers)
    from distlab.checks.show import verdict_text
    for text in verdict_text(task, lines):
        print(text)
    if not all(line.ok for line in lines) and held.getvalue().strip():
        sys.stderr.write(f"(output of the ranks while checking '{task.name}')\n{held.getvalue()[-6000:]}")
    return lines


def grader(tasks: dict[str, Task]) -> Callable[..., None]:
    """The `grade(name, *answers)` function of one lab: prints the task's verdict lines."""

    def grade(name: str, *answers: Any) -> None:
        if name not in tasks:
            raise KeyError(f"no graded task {name!r} in this lab; tasks: {sorted(tasks)}")
        task = tasks[name]
        if len(answers) != len(task.answers):
            raise TypeError(f"grade({name!r}, ...) takes {len(task.answers)} answer(s): {', '.join(task.answers)}")
        from distlab.course.stepwise import redefined_message
        lost = next((m for m in map(redefined_message, answers) if m), "")
        if lost:     # a class cell re-run after the cells that added methods to it: say so, run nothing
            for line in task.lines():
                print(Line(line, False, lost))
            return
        try:
            grade_task(task, *answers)
        except KeyboardInterrupt:
            # The launcher has already stopped every rank; a traceback through the package says nothing more.
            print(f"interrupted: the check of {name!r} was stopped before it finished (no rank is left running)")

    from distlab.checks.show import grade_doc
    grade.__doc__ = grade_doc(tasks)
    return grade
