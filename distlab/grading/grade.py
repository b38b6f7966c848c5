"""Grading one submission: its answers run sandboxed; every verdict is computed here.

`prepare` reads which tasks the shipped lab grades (`lab.load_lab`) and
computes every case's reference once, in this process, with no learner code
anywhere near it (from inputs drawn from a secret seed where the lab allows it,
`secret`; each rank then receives only its own). `run_answers` sends a submission's answer cells to a
runner (`sandbox`, `runner`); every rank's outputs (safetensors + JSON, see
`wire`) are first checked against their bounds in a child process with a
deadline (`resultcheck`): one that fails, or a child that does not answer in
time, zeroes the whole submission with the reason (an honest rank cannot
produce one). Then for each case it reads the ranks' event streams and
what their brokers booked (`evidence`), parses their outputs (`wire.decode`;
never a pickle), replaces their traffic figures by what was booked, validates them and calls
the task's own `judge` here. Evidence that learner code tampered zeroes every
line of the task it was seen in; the Audit column says what was seen. A
failure is a one-line reason, never an exception (`grade_one`); the class
run is `classrun.grade`.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

from distlab.checks.task import CHECK_STALL_S, Case, Line, Task, reference_of, reference_seconds, validate, work_cap_for
from distlab.checks.verdict import CheckFailed, reason
from distlab.grading import evidence, resultcheck, sandbox, secret, shortcuts, submission, wire
from distlab.grading.lab import ShippedLab, load_lab
from distlab.grading.sandbox import MAX_RESULT_BYTES, Limits


@dataclass
class Verdict:
    check: str
    points: float
    max_points: float
    reason: str = ""          # one line, empty when passed
    judged: str = ""          # the task's own verdict line, before any audit zeroed it
    task: str = ""            # the task it belongs to (a column of the gradebook)
    how: str = "enforced"     # or "detected" (see `how`)


@dataclass
class Result:
    submission: str
    verdicts: list[Verdict] = field(default_factory=list)
    note: str = ""            # one line about the whole submission (invalid JSON, runner killed, ...)
    flags: list[str] = field(default_factory=list)     # the Audit column: what was seen
    seconds: float = 0.0
    cpu_s: float = 0.0        # CPU seconds its sandbox used (runner, fork server, ranks)

    @property
    def score(self) -> float:
        return sum(v.points for v in self.verdicts)

    @property
    def max_score(self) -> float:
        return sum(v.max_points for v in self.verdicts)


@dataclass
class Options:
    sandbox: list[str] | None = None      # the bwrap argv, or None to run without a sandbox
    stall_s: float = CHECK_STALL_S        # a case's ranks idle this long: hung (the launcher's detection)
    # a rank busy past its case's work cap (`prepare`: the notebook's livelock bound) is stopped, its line named
    case_cap_s: float = 180.0             # last resort per launch (wall clock)
    submission_cap_s: float = 1800.0      # last resort per submission
    backend: str = "gloo"
    keep: Path | None = None              # keep each runner's log here
    progress: Callable[[str], None] | None = None
    limits: Limits = field(default_factory=Limits)     # per process, in the sandbox
    max_result_bytes: int = MAX_RESULT_BYTES           # all records of one submission


# Verdict lines that rest on what the audit hook saw inside a rank (its traffic, memory, placement): detected.
# Traffic lines are enforced where the ranks' brokers booked it (`distlab.grading.broker`: CPU/gloo ranks).
TRAFFIC_WORDS = ("traffic", "bytes", "messages", "sends")
DETECTED_WORDS = (*TRAFFIC_WORDS, "memory", "peak", "activations", "released", "streamed", "device", "host")


def how(line: str, audited: bool = False, brokered: bool = False) -> str:
    """'detected' when the line rests on what a rank's audit hook saw (or evidence zeroed it), else 'enforced':
    values judged here from the ranks' outputs, on inputs drawn from a secret seed, and (`brokered`) traffic
    that the ranks' brokers ran and booked."""
    last = line.rsplit(", ", 1)[-1]
    words = [w for w in DETECTED_WORDS if not (brokered and w in TRAFFIC_WORDS)]
    return "detected" if audited or any(w in last for w in words) else "enforced"


def one_line(text: Any, limit: int = 2000) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


@contextlib.contextmanager
def _references_on(backend: str) -> Iterator[None]:
    """A reference that launches ranks of its own (chapter 3's step, chapter 8's offload) runs on the
    graded ranks' backend: `--backend gloo` on a GPU box must not compute it on NCCL."""
    with mock.patch.dict(os.environ, {"DISTLAB_BACKEND": backend} if backend != "auto" else {}):
        yield


def prepare(lab: str | Path, only: list[str] | None = None, *, first_case: bool = False,
            backend: str = "gloo") -> ShippedLab:
    """The lab, its selected tasks (`first_case`: each task's first case only), and every graded case's
    reference computed once (here, no learner code), on `backend` (the graded ranks')."""
    with _references_on(backend):
        return _prepare(lab, only, first_case=first_case)


def _prepare(lab: str | Path, only: list[str] | None, *, first_case: bool) -> ShippedLab:
    the_lab = load_lab(lab).select(only)
    if first_case:
        the_lab.first_cases()
    for graded in the_lab.graded:
        cases = graded.task.cases()
        for i in graded.cases:
            drawn = secret.draw(graded.task, cases[i])     # from a secret seed, or None: fixed inputs
            if drawn is None:
                seconds = reference_seconds(graded.task, cases[i])     # cached, with the time it took once
            else:
                start = time.monotonic()
                the_lab.references[graded.task.name, i] = graded.task.reference(cases[i], inputs=drawn)
                seconds = time.monotonic() - start
                the_lab.inputs[graded.task.name, i] = [secret.blob(x) for x in drawn]
            # a busy loop (livelock) is stopped at the notebook's bound: 10x the reference, at least 6 CPU s
            the_lab.work_caps[graded.task.name, i] = work_cap_for(seconds)
    return the_lab


def _case_outputs(record: dict, seen: list[str], lab: str = "") -> list[Any]:
    """One case's outputs, safe to judge; evidence found on the way goes to `seen`."""
    streams = record.get("streams") or []
    flooded = record.get("flooded") or [False] * len(streams)
    brokers = record.get("brokers")
    logs = [evidence.read_stream(_b64(s), bool(f), _b64(brokers[r]) if brokers and r < len(brokers) else None)
            for r, (s, f) in enumerate(zip(streams, flooded))]
    for r, log in enumerate(logs):
        seen += [f"rank {r}: {e}" for e in log.evidence]
        other = shortcuts.other_ops(lab, log.op_calls)
        if other:
            seen.append(f"rank {r}: called {', '.join(other)}: this lab allows only "
                        f"{'/'.join(sorted(shortcuts.ONLY_OPS[lab]))}, in every call of the check")
    if record.get("status") != "ok":
        raise CheckFailed(record.get("reason") or "the case failed")
    blobs = [_b64(b) for b in record.get("outputs") or []]
    if len(blobs) != len(logs) or not blobs:
        raise CheckFailed("malformed result: outputs and audit streams do not match the ranks")
    outputs = []
    for r, (blob, log) in enumerate(zip(blobs, logs)):
        if log.problem:
            seen.append(f"rank {r}: {log.problem}")
        try:
            raw = wire.decode(blob)       # bounded: `checked` passed every blob in a child first
        except Exception as exc:  # noqa: BLE001 - malformed in a way the bounds allow
            raise CheckFailed(f"malformed result from rank {r} ({type(exc).__name__})") from None
        problems: list[str] = []
        outputs.append(evidence.substitute(raw, log, problems))
        seen += [f"rank {r}: {p}" for p in dict.fromkeys(problems)]
    return outputs


def _b64(text: Any) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError):
        return b""


def summarize(seen: list[str], limit: int = 8) -> list[str]:
    """Evidence lines once each, with the ranks that showed them ('rank 0: x', 'rank 1: x' -> 'x (ranks 0, 1)');
    process ids in /proc paths do not make lines distinct."""
    ranks: dict[str, list[str]] = {}
    for item in seen:
        who, _, what = item.partition(": ") if item.startswith("rank ") else ("", "", item)
        what = re.sub(r"/proc/\d+/", "/proc/<pid>/", what)
        ranks.setdefault(what, [])
        if who and who[5:] not in ranks[what]:
            ranks[what].append(who[5:])
    out = [what + (f" [rank {', '.join(r)}]" if len(r) == 1 else f" [ranks {', '.join(r)}]" if r else "")
           for what, r in ranks.items()]
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def judge_case(task: Task, case: Case, record: dict | None, seen: list[str], failure: str = "", lab: str = "",
               reference: Any = None) -> list[Line]:
    """The verdict lines of one case, judged here from the runner's record (like `run_task`); `reference`:
    the case's reference when its inputs were drawn secretly (else the task's own, cached)."""
    try:
        if record is None:
            raise CheckFailed(f"not run: {failure or 'the runner sent no result for this case'}")
        outputs = _case_outputs(record, seen, lab)
        validate(outputs)
        ref = reference_of(task, case) if reference is None else reference
    except Exception as exc:  # noqa: BLE001 - every failure is a verdict
        return [Line(n, False, reason(exc, task.hang_hint)) for n in case.lines]
    try:
        lines = {line.name: line for line in task.judge(case, outputs, ref)}
    except Exception as exc:  # noqa: BLE001 - a malformed output must not crash the verdict
        lines = {n: Line(n, False, f"malformed result from the ranks ({type(exc).__name__})") for n in case.lines}
    return [lines.get(n, Line(n, False, "no verdict (malformed result)")) for n in case.lines]


def checked(records: list[dict]) -> str:
    """'' when every rank's outputs in `records` respect the result bounds (checked in a child process with a
    deadline, `resultcheck.check_in_child`); else why not, for the whole submission (one line)."""
    where, blobs = [], []
    for rec in records:
        if rec.get("kind") == "case" and rec.get("status") == "ok":
            for r, b in enumerate(rec.get("outputs") or []):
                where.append(f"{rec.get('task')}, {rec.get('world_size')} ranks, rank {r}")
                blobs.append(_b64(b))
    if not blobs:
        return ""
    for place, why in zip(where, resultcheck.check_in_child(blobs)):
        if why:
            return f"malformed result ({place}: {why}): not graded"
    return ""


def judge(lab: ShippedLab, outcome: sandbox.Outcome, outside: list[str] | None = None
          ) -> tuple[list[Verdict], list[str]]:
    """Every graded line from the runner's records; (verdicts, audit flags). `outside`: evidence found here
    without running anything (the lab's library shortcuts named in the answer cells), for every task."""
    bad = checked(outcome.records)
    if bad:
        outcome.failure = outcome.failure or bad
        return [Verdict(line, 0, g.task.points, one_line(bad), task=g.task.name, how=how(line))
                for g in lab.graded for line in g.lines], [bad]
    records = {(r.get("task"), r.get("case")): r for r in outcome.records if r.get("kind") == "case"}
    brokered = any("brokers" in r for r in records.values())
    verdicts, flags = [], []
    for graded in lab.graded:
        task, cases, seen = graded.task, graded.task.cases(), list(outside or [])
        lines = [line for i in graded.cases
                 for line in judge_case(task, cases[i], records.get((task.name, i)), seen, outcome.failure,
                                        lab.name, lab.references.get((task.name, i)))]
        seen = summarize(seen)
        flags += [f"{task.name}: {s}" for s in seen]
        for line in lines:
            if seen:
                verdicts.append(Verdict(line.name, 0, task.points, one_line(f"audit: {seen[0]}"), str(line),
                                        task.name, "detected"))
            else:
                verdicts.append(Verdict(line.name, task.points if line.ok else 0, task.points,
                                        "" if line.ok else one_line(line.detail or "failed"), str(line), task.name,
                                        how(line.name, brokered=brokered)))
    return verdicts, flags


def _part(lab: ShippedLab, answers: list[tuple[str, str]]) -> dict:
    """One lab's share of a runner's job: its graded cases, the answer cells, each case's secret inputs."""
    return {"lab": lab.name, "tasks": [(g.task.name, list(g.cases)) for g in lab.graded], "cells": answers,
            "names": {g.task.name: list(g.names) for g in lab.graded},
            "inputs": {f"{t}/{i}": [base64.b64encode(b).decode() for b in blobs]
                       for (t, i), blobs in lab.inputs.items() if any(g.task.name == t and i in g.cases
                                                                      for g in lab.graded)},
            "work_caps": {f"{t}/{i}": cap for (t, i), cap in lab.work_caps.items()}}


def run_answers(lab: ShippedLab, answers: list[tuple[str, str]], name: str, opts: Options
                ) -> tuple[list[Verdict], list[str], str, float]:
    """Run one set of answer cells in a runner and judge it: (verdicts, audit flags, runner failure, CPU s)."""
    ((verdicts, flags, failure),), cpu_s = run_together([(lab, answers)], name, opts)
    return verdicts, flags, failure, cpu_s


def run_together(parts: list[tuple[ShippedLab, list[tuple[str, str]]]], name: str, opts: Options
                 ) -> tuple[list[tuple[list[Verdict], list[str], str]], float]:
    """One hand-in's answers to several labs, run in turn by one runner in one sandbox (one interpreter and
    fork server for all of them: a learner checking every lab, or a whole course's solutions), each part judged
    on its own records (a lab may come more than once): ([(verdicts, audit flags, runner failure)] in the order
    of `parts`, CPU s of all)."""
    job = {"stall_s": opts.stall_s, "cap_s": opts.case_cap_s, "backend": opts.backend}
    if len(parts) == 1:
        job.update(_part(*parts[0]))
    else:
        job["parts"] = [_part(lab, answers) for lab, answers in parts]
    if opts.keep:
        log = Path(opts.keep) / f"{Path(name).stem}.runner.log"
        log.parent.mkdir(parents=True, exist_ok=True)
    else:
        handle, raw = tempfile.mkstemp(prefix="distlab-runner-", suffix=".log")
        os.close(handle)
        log = Path(raw)
    on_record = None
    if opts.progress is not None:
        total, count = sum(len(g.cases) for lab, _ in parts for g in lab.graded), [0]

        def on_record(rec: dict) -> None:
            if rec.get("kind") == "case":
                count[0] += 1
                ok = rec.get("status") == "ok"
                opts.progress(f"[{count[0]}/{total}] {rec.get('task')}, {rec.get('world_size')} ranks: "
                              + ("ran" if ok else one_line(rec.get("reason", ""), 120)))
    try:
        outcome = sandbox.run(job, sandbox=opts.sandbox, cap_s=opts.submission_cap_s, log=log, on_record=on_record,
                              limits=opts.limits, max_result_bytes=opts.max_result_bytes)
    finally:
        if not opts.keep:
            log.unlink(missing_ok=True)
    out = []
    for k, (lab, answers) in enumerate(parts):
        mine = dataclasses.replace(outcome, records=[r for r in outcome.records if r.get("kind") != "case" or (
            r.get("part") == k and r.get("lab") == lab.name)])
        verdicts, flags = judge(lab, mine, shortcuts.named(lab.name, [source for _, source in answers]))
        out.append((verdicts, flags, mine.failure))
    return out, outcome.cpu_s


def failed(lab: ShippedLab, name: str, note: str) -> Result:
    """A submission that could not be graded: every line 0 with `note` as its reason."""
    return Result(name, [Verdict(line, 0, g.task.points, one_line(note), task=g.task.name, how=how(line))
                         for g in lab.graded for line in g.lines], note=one_line(note))


def read_answers(lab: ShippedLab, path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """A submission's answer cells and notes on missing ones; BadSubmission when it is not a notebook."""
    return submission.answers(lab, submission.read(path))


def grade_answers(lab: ShippedLab, answers: list[tuple[str, str]], notes: list[str], name: str,
                  opts: Options) -> Result:
    """One submission's answer cells run and judged (`notes`: what reading them found); never raises."""
    start = time.monotonic()
    try:
        verdicts, flags, failure, cpu_s = run_answers(lab, answers, name, opts)
        res = Result(name, verdicts, one_line("; ".join(notes + ([failure] if failure else []))), flags,
                     cpu_s=cpu_s)
    except Exception as exc:  # noqa: BLE001 - one broken submission never stops the class
        res = failed(lab, name, f"internal error while grading ({type(exc).__name__}: {exc}); please report it")
    res.seconds = time.monotonic() - start
    return res


def grade_one(lab: ShippedLab, path: Path, name: str, opts: Options) -> Result:
    """One submission, start to end; never raises (a failure is the Result's note)."""
    try:
        answers, missing = read_answers(lab, path)
    except submission.BadSubmission as exc:
        return failed(lab, name, str(exc))
    except Exception as exc:  # noqa: BLE001 - one broken submission never stops the class
        return failed(lab, name, f"internal error while reading ({type(exc).__name__}: {exc})")
    return grade_answers(lab, answers, missing, name, opts)
