"""Reading a rank's event stream: the traffic it really sent, and what its learner code did.

A stream (see `distlab.grading.audithook`) starts with the rank's 32-byte key,
followed by sealed records. `read_stream` verifies them and returns a
`RankLog`: the comm ops booked inside each `track_comm` region, the
evidence lines, and the digest the rank's trusted code gave its outputs.

What counts as evidence (each zeroes the task it was seen in):
- an `ev` record (learner code read frames or other objects' internals,
  replaced code, used ctypes, processes, threads, signals or sockets, touched
  files outside the Python environment and the package, forged a distlab
  audit event);
- a `changed` record (a distlab / torch.distributed function or class rebound);
- a stream that does not verify, or ends before the rank's `finish` record
  although the rank returned outputs, or whose (first) digest does not match them;
  a second `finish` record;
- traffic figures in the outputs that no check-opened region measured.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from distlab.grading.channel import read_records
from distlab.meters.comm import CommStats

KEY_BYTES = 32


@dataclass
class RankLog:
    """What one rank's stream says."""

    regions: dict[int, CommStats] = field(default_factory=dict)   # region -> traffic booked in it
    learner_regions: set[int] = field(default_factory=set)        # regions opened with learner code on the stack
    op_calls: dict[str, int] = field(default_factory=dict)        # every op the rank ran, in a region or not
    evidence: list[str] = field(default_factory=list)             # one short line each
    digest: str = ""                                              # sha256 of the outputs, from `finish`
    problem: str = ""                                             # why the stream cannot be trusted past a point


def read_stream(raw: bytes, flooded: bool = False, broker: bytes | None = None) -> RankLog:
    """Verify and interpret one rank's stream (`raw`: everything the runner read from its FIFO). `broker`: what
    the rank's broker booked (`distlab.grading.broker`); when given, the traffic is its, never the rank's."""
    log = RankLog()
    if len(raw) < KEY_BYTES:
        log.problem = "its audit stream is missing (the rank never started one)"
        return log
    stream = read_records(raw[KEY_BYTES:], raw[:KEY_BYTES])
    open_regions: dict[int, tuple[dict, dict]] = {}
    hook_regions: list[tuple[str, int]] = []
    for payload in stream.records:
        fields = payload.decode("utf-8", "replace").split("\t")
        kind = fields[0]
        if kind == "op" and len(fields) >= 3 and broker is None:
            log.op_calls[fields[1]] = log.op_calls.get(fields[1], 0) + 1
            for calls, sent in open_regions.values():
                calls[fields[1]] = calls.get(fields[1], 0) + 1
                sent[fields[1]] = sent.get(fields[1], 0) + int(fields[2])
        elif kind == "region" and len(fields) >= 4:
            k = int(fields[2])
            if fields[3] == "1":
                log.learner_regions.add(k)
            if broker is not None:
                hook_regions.append((fields[1], k))
            elif fields[1] == "begin":
                open_regions[k] = ({}, {})
            elif k in open_regions:
                calls, sent = open_regions.pop(k)
                log.regions[k] = CommStats(calls, {kind_: sent.get(kind_, 0) for kind_ in calls})
        elif kind == "ev" and len(fields) >= 4:
            log.evidence.append(_describe(fields[1], fields[2], fields[3]))
        elif kind == "changed" and len(fields) >= 3:
            log.evidence.append(f"rebound {fields[1]} ({fields[2]})")
        elif kind == "finish" and len(fields) >= 2:
            if log.digest:     # the first finish wins; another one is evidence
                log.evidence.append("a second finish record (only the first counts)")
            else:
                log.digest = fields[1]
    if broker is not None and not broker:
        log.problem = "its broker's bookings are missing or were flooded"
    elif broker is not None:
        _read_broker(broker, log, hook_regions)
    if stream.problem:
        log.problem = f"its audit stream was tampered with: {stream.problem}"
    if flooded:
        log.problem = "its audit stream was flooded"
    return log


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


def check_outputs(log: RankLog, data: bytes) -> str:
    """'' when the rank's stream vouches for `data`; else why not (evidence)."""
    if log.problem:
        return log.problem
    if not log.digest:
        return "its audit stream ended before the rank returned"
    if hashlib.sha256(data).hexdigest() != log.digest:
        return "its outputs were changed after the check produced them"
    return ""


def substitute(obj: object, log: RankLog, problems: list[str], depth: int = 0) -> object:
    """`obj` with every region reference replaced by the traffic the hook booked in that region.

    A reference the hook never vouched for (-1: figures the check's meter did
    not produce; -2: a region learner code opened) is evidence, added to
    `problems`, and replaced by an empty CommStats.
    """
    from distlab.grading.rankside import REGION_KEY
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
