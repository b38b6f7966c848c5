"""What a graded rank runs: the audit hook and the metered group first, then the learner's cells.

The sandbox runner launches `run_case(...)` on every rank of one case with
`distlab.launch`. In order, before any learner code:

0. it becomes non-dumpable (`seccomp.no_dump`: no sibling rank opens its pipes through /proc/<pid>/fd), then
   its secret inputs, when the lab's are drawn by the grader (`distlab.grading.secret`);
1. its pipes to its broker (`distlab.grading.broker`, CPU/gloo ranks), then
   `audithook.install`: the rank's event stream, the hook;
2. the lab's library shortcuts are watched (`distlab.grading.shortcuts`), and
   the default process group is re-created as a `MeteredGroup`
   (`distlab.grading.pgmeter`), so every collective goes through the hook to
   the rank's broker, which runs and books it (on NCCL: the hook runs and books it);
3. `track_comm` blocks announce themselves to the hook (regions).

4. the rank's resource limits are lowered (CPU seconds of one case) and, with
   its process group up, a seccomp filter (`distlab.grading.seccomp`) stops
   this thread and every thread or process it starts from creating sockets,
   processes or sessions: the kernel enforces it, whatever learner code does.

Then the learner's answer cells run after the lab's PRELUDE in a fresh
namespace (as in the notebook, with nothing else from it), the task's
`exercise` runs with the learner's objects, and the outputs go back as
safetensors bytes with their structure as JSON (`distlab.grading.wire`; no
pickle). Every `CommStats` in them is replaced by a reference to the
region it measured (`{"__distlab_region__": k}`; -1 when the hook never saw
it measured, -2 when learner code opened it), so the grader judges traffic
from what the broker booked in that region (on NCCL: the hook), never from
what the rank reports.
"""
from __future__ import annotations

import builtins
import os
import resource
import sys
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist

from distlab.grading import audithook, broker, pgmeter, seccomp, secret, shortcuts, wire
from distlab.grading.wire import REGION_KEY
# What a check's rank-side half relies on: rebinding a function or class attribute here is evidence. (Other
# modules are left alone: torch itself rewraps e.g. every optimizer class's `step` on first use, and a
# learner who breaks them only breaks their own outputs, which are judged in the grader.)
WATCHED_PREFIXES = ("distlab.checks", "distlab.meters", "distlab.grading")
WATCHED = ("distlab.engine.runtime", "distlab.engine.launch", "distlab.engine.collectives", "distlab.course.collectives",
           "torch.distributed", "torch.distributed.distributed_c10d")


class GradingError(RuntimeError):
    """The learner's notebook cannot provide what a check needs (e.g. a missing function)."""


def _region_methods() -> dict[str, Any]:
    """Wrap `_CommMeter.__enter__/__exit__/stats` so the hook sees each `track_comm` block."""
    from distlab.meters.comm import _CommMeter
    audit = sys.audit
    enter, exit_, stats = _CommMeter.__enter__, _CommMeter.__exit__, _CommMeter.stats

    def __enter__(self: Any) -> Any:
        audit("distlab.region", "begin", self)
        return enter(self)

    def __exit__(self: Any, *exc: Any) -> Any:
        audit("distlab.region", "end", self)
        return exit_(self, *exc)

    def stats_(self: Any) -> Any:
        snapshot = stats(self)
        audit("distlab.region", "stats", self, snapshot)
        return snapshot

    def _add(self: Any, kind: str, sent: int) -> None:
        """The dispatch mode counts nothing here: the audit hook adds each op of the metered group to the
        open meters (the mode would count DTensor's functional collectives a second time)."""

    for name, fn in (("__enter__", __enter__), ("__exit__", __exit__), ("stats", stats_), ("_add", _add)):
        setattr(_CommMeter, name, fn)
    return {"__enter__": __enter__, "__exit__": __exit__, "stats": stats_}


def _metered_group(timeout_s: float, stall_s: float | None = None) -> None:
    """Re-create the default group (set up by `distlab.launch`) as a MeteredGroup on the same ranks. On NCCL
    its timeout is the stall window, as the launcher's own NCCL group's (`runtime.group_timeout_s`): a rank
    spinning behind a hung kernel is told from a working one only by NCCL's watchdog."""
    from distlab.engine.runtime import group_timeout_s
    kind = "nccl" if dist.get_backend() == "nccl" else "gloo"
    group_s = group_timeout_s(kind, timeout_s, stall_s)
    name = f"metered_{kind}"
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, partial(pgmeter.create, backend_name=name), extended_api=True,
                                      devices=["cuda", "cpu"] if kind == "nccl" else ["cpu"])
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore("distlab-grade/", store)
    # Every rank has finished joining the launcher's group before any rank tears it down: a rank that closes
    # its connections while a slower peer is still connecting fails that peer ("Connection closed by peer",
    # seen on a loaded machine).
    prefixed.set(f"joined{rank}", "1")
    prefixed.wait([f"joined{r}" for r in range(size)], timedelta(seconds=timeout_s))
    dist.destroy_process_group()
    dist.init_process_group(name, store=prefixed, rank=rank, world_size=size, timeout=timedelta(seconds=group_s))


def _cpu_limit(seconds: float) -> None:
    """This rank may use `seconds` of CPU more (the case's cap): past it the kernel stops it (SIGXCPU)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard if hard != resource.RLIM_INFINITY else soft + 5))


def _exec_cells(prelude: str, prelude_name: str, cells: list[tuple[str, str]]) -> tuple[dict, list[str]]:
    """PRELUDE + the learner's cells in a fresh namespace; (namespace, one line per cell that raised)."""
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(prelude, prelude_name, "exec"), ns)  # noqa: S102 - the lab's own imports
    errors = []
    for cell_id, source in cells:
        try:
            exec(compile(source, f"<answer cell {cell_id}>", "exec"), ns)  # noqa: S102 - the learner's cell
        except BaseException as exc:  # noqa: BLE001 - reported when a name the check needs is missing
            first = str(exc).splitlines()[0] if str(exc) else ""
            where = f" (line {exc.lineno}: {(exc.text or '').strip()})" if isinstance(exc, SyntaxError) else ""
            errors.append(f"{type(exc).__name__}: {first}{where}"[:600])
    return ns, errors


def _finisher() -> Any:
    """`finish(outputs)`: the outputs as safetensors bytes, each `CommStats` in them replaced by the hook's
    region reference (`distlab.lookup`); the stream's `end` record sent (`distlab.finish`). Built before
    learner code: what it uses is bound here."""
    from torch import Tensor

    from distlab.meters.comm import CommStats
    audit, dumps, _type, _dict, _list, _tuple = sys.audit, wire.encode, type, dict, list, tuple

    def collect(x: Any, found: list, depth: int = 0) -> None:
        t = _type(x)
        if t is CommStats:
            found.append(x)
        elif depth < 20 and t is _dict:
            for v in x.values():
                collect(v, found, depth + 1)
        elif depth < 20 and (t is _list or t is _tuple):
            for v in x:
                collect(v, found, depth + 1)

    def swap(x: Any, refs: dict, depth: int = 0) -> Any:
        t = _type(x)
        if t is CommStats:
            return {REGION_KEY: refs.get(id(x), -1)}
        if t is Tensor:      # a plain CPU copy: no CUDA storage, no attributes a meter or audit attached
            copy = x.detach().cpu().clone()
            copy.__dict__.clear()
            return copy
        if depth < 20 and t is _dict:
            return {k: swap(v, refs, depth + 1) for k, v in x.items()}
        if depth < 20 and (t is _list or t is _tuple):
            return t(swap(v, refs, depth + 1) for v in x)
        return x

    def finish(outputs: Any) -> bytes:
        found: list = []
        collect(outputs, found)
        regions: list = []
        audit("distlab.lookup", found, regions)
        data = dumps(swap(outputs, {id(s): k for s, k in zip(found, regions)}))
        audit("distlab.finish")
        return data

    return finish


def run_case(lab: str, task_name: str, case_index: int, cells: list[tuple[str, str]], names: list[str],
             stream_paths: list[str], timeout_s: float, input_paths: list[str] | None = None,
             stall_s: float | None = None, broker_paths: list[tuple[str, str]] | None = None) -> bytes:
    """On every rank: one case of one task with the learner's cells; returns the outputs (safetensors bytes).
    `input_paths`: one FIFO per rank holding its secret inputs (`distlab.grading.secret`); `broker_paths`: each
    rank's request and reply FIFOs to its broker (`distlab.grading.broker`), which then owns the real groups."""
    # non-dumpable first, before its pipes open: no sibling rank (same uid) reaches them through /proc/<pid>/fd
    seccomp.no_dump()
    # then: every rank has read and unlinked its own before any rank runs learner code
    mine = secret.load(secret.receive(input_paths[dist.get_rank()])) if input_paths else None
    # opened by every rank before the barrier in `_metered_group`: its broker unlinks them then
    client = broker.Client(*broker_paths[dist.get_rank()]) if broker_paths else None
    from distlab.checks import lab_module
    from distlab.meters.comm import _CommMeter  # noqa: F401 - imported before learner code
    audit, finish = sys.audit, _finisher()
    module = lab_module(lab)      # imported before the hook's snapshot, so its classes are watched too
    task = module.TASKS[task_name]
    case = task.cases()[case_index]
    region = _region_methods()
    shortcut_codes, shortcut_modules = shortcuts.watch(lab)
    shortcuts.hide(lab)
    audithook.install(stream_paths[dist.get_rank()], {
        "distlab.pg.op": pgmeter.MeteredGroup._op.__code__,
        "distlab.pg.create": pgmeter.create.__code__,
        "distlab.region": [fn.__code__ for fn in region.values()],
        "distlab.lookup": finish.__code__,
        "distlab.finish": finish.__code__,
        "distlab.checkpoint": run_case.__code__,
        "distlab.shortcut": shortcut_codes,
    }, snapshot_modules=tuple(sorted(m for m in sys.modules if m.startswith(WATCHED_PREFIXES) or m in WATCHED
                                     or m in shortcut_modules)), broker=client)
    _metered_group(timeout_s, stall_s)
    # On NCCL, a batch_isend_irecv on the (Python) metered group runs grouped, as it would without the grader.
    dist.batch_isend_irecv = pgmeter.grouped_batch_isend_irecv(dist.batch_isend_irecv)
    _cpu_limit(timeout_s)
    seccomp.confine(sockets=dist.get_backend() != "metered_nccl")
    audit("distlab.checkpoint", "snapshot")
    ns, errors = _exec_cells(module.PRELUDE, f"{module.__file__}#PRELUDE", cells)
    audit("distlab.checkpoint", "after your answer cells ran")
    answers = []
    for name in names:
        if name not in ns:
            why = f" (your answer cells raised {'; '.join(errors)})" if errors else ""
            raise GradingError(f"your notebook does not define {name}{why}")
        answers.append(ns[name])
    outputs = task.exercise(case, *answers) if mine is None else task.exercise(case, *answers, inputs=mine)
    audit("distlab.checkpoint", "while the check ran")
    return finish(outputs)
