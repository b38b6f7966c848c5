"""Reading a rank's event stream: the traffic it sent, and what its learner code did.

A stream (see `distlab.grading.audithook`) is plain text, one record a line:
`kind<TAB>field...`. It carries no key and no seal: it is written from inside
the rank, where learner code runs and can write into it too (its file
descriptor is the rank's own). So the stream is *detected* evidence, and the
grader believes it only in the directions a learner gains nothing from:

- a record of what learner code did (`ev`, `changed`) only ever zeroes a task;
- traffic on CPU (gloo) is what the rank's broker booked (`distlab.grading.broker`),
  never the stream; there `op` and `pg` records are lines the hook does not
  write, so a stream holding one is refused (traffic records a learner appended);
- a stream that does not parse (a line the hook never writes: unknown kind,
  wrong number of fields, a record cut off), or whose `end` record (sent by
  the trusted code that hands the outputs back) is missing or repeated, is
  refused (`RankLog.problem`): an honest rank's stream has exactly one.
  Refused means the rank's task scores zero. (Records after the `end` are
  read as usual: learner code may still run, a finalizer say, and be booked.)

What this cannot catch: learner code that takes over its own process can close
or redirect the hook's descriptor and write a plausible stream of its own (an
`end` included). That is why a verdict resting on the stream (a forbidden
class, on NCCL the traffic) is labelled detected, never enforced.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from distlab.meters.comm import CommStats

# kind -> number of tab-separated fields, kind included (what `audithook` writes)
FIELDS = {"pg": 4, "op": 4, "region": 4, "ev": 4, "changed": 3, "end": 1}


@dataclass
class RankLog:
    """What one rank's stream says."""

    regions: dict[int, CommStats] = field(default_factory=dict)   # region -> traffic booked in it
    learner_regions: set[int] = field(default_factory=set)        # regions opened with learner code on the stack
    op_calls: dict[str, int] = field(default_factory=dict)        # every op the rank ran, in a region or not
    evidence: list[str] = field(default_factory=list)             # one short line each
    problem: str = ""                                             # why the stream is refused (zeroes the task)


def read_stream(raw: bytes, flooded: bool = False, broker: bytes | None = None) -> RankLog:
    """Interpret one rank's stream (`raw`: everything the runner read from its FIFO). `broker`: what the rank's
    broker booked (`distlab.grading.broker`); when given, the traffic is its, never the stream's."""
    log = RankLog()
    lines = raw.decode("utf-8", "replace").split("\n")
    if lines[-1]:
        log.problem = "its audit stream ends inside a record (cut off, or bytes the audit hook did not write)"
    open_regions: dict[int, tuple[dict, dict]] = {}
    hook_regions: list[tuple[str, int]] = []
    ends = 0
    for n, line in enumerate(lines[:-1]):
        fields = line.split("\t")
        kind = fields[0]
        if FIELDS.get(kind) != len(fields) or (broker is not None and kind in ("op", "pg")) or (ends and kind == "end"):
            log.problem = log.problem or f"its audit stream holds a line the audit hook did not write (line {n + 1})"
            break
        if kind == "op":
            log.op_calls[fields[1]] = log.op_calls.get(fields[1], 0) + 1
            for calls, sent in open_regions.values():
                calls[fields[1]] = calls.get(fields[1], 0) + 1
                sent[fields[1]] = sent.get(fields[1], 0) + _int(fields[2])
        elif kind == "region":
            k = _int(fields[2])
            if fields[3] == "1":
                log.learner_regions.add(k)
            if broker is not None:
                hook_regions.append((fields[1], k))
            elif fields[1] == "begin":
                open_regions[k] = ({}, {})
            elif k in open_regions:
                calls, sent = open_regions.pop(k)
                log.regions[k] = CommStats(calls, {kind_: sent.get(kind_, 0) for kind_ in calls})
        elif kind == "ev":
            log.evidence.append(_describe(fields[1], fields[2], fields[3]))
        elif kind == "changed":
            log.evidence.append(f"rebound {fields[1]} ({fields[2]})")
        elif kind == "end":
            ends += 1
    if not ends:
        log.problem = log.problem or "its audit stream ended before the rank returned (cut off or closed)"
    if broker is not None and not broker:
        log.problem = "its broker's bookings are missing or were flooded"
    elif broker is not None:
        _read_broker(broker, log, hook_regions)
    if flooded:
        log.problem = "its audit stream was flooded"
    return log


def _int(text: str) -> int:
    return int(text) if text.lstrip("-").isdigit() else -1


def _read_broker(raw: bytes, log: RankLog, hook_regions: list[tuple[str, int]]) -> None:
    """The traffic a rank's broker booked, by region; its region markers must be the check's, in order."""
    seen: list[tuple[str, int]] = []
    for line in raw.decode("utf-8", "replace").splitlines(keepends=True):
        fields = line.rstrip("\n").split("\t")
        if not line.endswith("\n"):
            break     # cut off when the broker was stopped
        if fields[0] == "kind" and len(fields) >= 2:
            log.op_calls[fields[1]] = log.op_calls.get(fields[1], 0) + 1
        elif fields[0] == "region" and len(fields) >= 3:
            k = int(fields[2])
            seen.append((fields[1], k))
            if fields[1] == "end" and len(fields) >= 5:
                calls, sent = json.loads(fields[3]), json.loads(fields[4])
                log.regions[k] = CommStats({str(a): int(b) for a, b in calls.items()},
                                           {str(a): int(sent.get(a, 0)) for a in calls})
        elif fields[0] == "ev" and len(fields) >= 3:
            log.evidence.append(f"{fields[1]}: {fields[2]}")
    # a region the broker never closed has no traffic: `substitute` finds figures no region produced
    if seen != hook_regions[: len(seen)]:
        log.evidence.append("its broker's traffic regions do not match the check's (markers forged or lost)")


def _describe(event: str, detail: str, where: str) -> str:
    where = where.replace("<answer cell ", "answer cell ").replace(">", "")
    sep = ": " if event.startswith("used ") else " "
    return f"{event}{sep}{detail}".strip() + (f" ({where})" if where else "")


def substitute(obj: object, log: RankLog, problems: list[str], depth: int = 0) -> object:
    """`obj` with every region reference replaced by the traffic booked in that region.

    A reference nothing vouched for (-1: figures the check's meter did not
    produce; -2: a region learner code opened) is evidence, added to
    `problems`, and replaced by an empty CommStats.
    """
    from distlab.grading.wire import REGION_KEY
    if type(obj) is dict and set(obj) == {REGION_KEY} and type(obj[REGION_KEY]) is int:
        k = obj[REGION_KEY]
        if k == -2 or k in log.learner_regions:
            problems.append("traffic figures from a meter that learner code opened")
        elif k < 0 or k not in log.regions:
            problems.append("traffic figures that the check's meter did not produce")
        return log.regions.get(k, CommStats()) if k >= 0 and k not in log.learner_regions else CommStats()
    if depth < 20 and type(obj) is dict:
        return {key: substitute(v, log, problems, depth + 1) for key, v in obj.items()}
    if depth < 20 and type(obj) in (list, tuple):
        return type(obj)(substitute(v, log, problems, depth + 1) for v in obj)
    return obj
