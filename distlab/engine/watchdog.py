"""On NCCL: a hung collective told apart from a late peer, and NCCL's watchdog abort recognised.

Three facts shape this module:

- On NCCL a rank that waits for a kernel spins at 100 % CPU, so the launcher's CPU-time monitor
  cannot see a hang there.
- NCCL's own watchdog can, but it counts from the moment the host *enqueued* the op. A timeout as
  short as a stall window (1-5 s) aborts a rank whose peer is merely late: the first cuBLAS or NCCL
  set-up, a new point-to-point communicator, a loaded 8-GPU box.
- What NCCL prints when it aborts a rank is worded by each release as it likes.

So the group's timeout gets a floor (`nccl_timeout_s`: at least `FLOOR_S`, and always `MARGIN_S` past
the stall window), and each NCCL rank runs a `HangWatch`: a thread that reads PyTorch's flight
recorder (the ops this rank issued, and which of them completed) and shares one status line with the
other ranks through the launch's store. It reports a hang after the stall window only when every
unfinished rank waits for an op of its own and no rank has issued or completed an op in that window.
A peer that is late is working (it has no op outstanding yet), so its partners are never reported.
An op that no verdict covers (a peer stuck in host code) is reported by the watch just before NCCL's
own timeout, in the same words. When a rank dies anyway, `abort_reason` recognises NCCL's watchdog
by what an abort leaves: the flight recorder's dump, the watch's last status with an abort signal,
and only then the text.

Known limit: the flight recorder tells issued from completed, not a kernel that is still moving bytes
from one waiting for its peer, so one collective that takes longer than the whole stall window on
every rank (gigabytes over PCIe with `stall=1`) would be reported. The default NCCL window (60 s) is
far beyond any single collective of the course.
"""
from __future__ import annotations

import glob
import io
import json
import os
import pickle
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

FLOOR_S = 30.0      # NCCL's timeout never goes below this: a late peer has tens of seconds to join
MARGIN_S = 10.0     # ... and never ends before the watch has had the stall window plus this
REPORT_EARLY_S = 5.0  # the watch's last resort comes this long before NCCL's own timeout
PERIOD_S = 0.25     # how often a watch reads the flight recorder and the store
DUMP_PREFIX = "nccl_trace_rank_"   # the flight recorder's dump file, per rank, in the launch's folder
BUFFER_ENTRIES = "512"             # flight-recorder entries kept when the user set none
_KEY = "distlab/watch/{}"


def nccl_timeout_s(stall_s: float | None) -> float:
    """NCCL's timeout for a launch with this stall window: max(FLOOR_S, stall + MARGIN_S) s, or
    $DISTLAB_NCCL_TIMEOUT_S (never below stall + MARGIN_S: the watch must speak first)."""
    stall = float(stall_s or 0.0)
    floor = float(os.environ.get("DISTLAB_NCCL_TIMEOUT_S") or FLOOR_S)
    return max(floor, stall + MARGIN_S)


def prepare(workdir: str) -> None:
    """Before a rank builds its NCCL group: turn the flight recorder on (unless the user configured it)
    and send its dump on a timeout into the launch's folder, where `abort_reason` looks."""
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.setdefault(key, os.environ.get("TORCH_FR_BUFFER_SIZE")
                              or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or BUFFER_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    for key in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ[key] = os.path.join(workdir, DUMP_PREFIX)


# ---- what a rank says about itself ----------------------------------------------------------------

@dataclass
class Status:
    """One rank's state, as its watch publishes it."""
    waiting: bool = False     # an op this rank issued has not completed
    idle_s: float = 0.0       # seconds since this rank last issued or completed an op
    finished: bool = False    # its function returned and its GPU work completed
    op: str = ""              # the oldest incomplete op, described (with the line that issued it)

    def line(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str | bytes) -> "Status | None":
        try:
            d = json.loads(text)
            return cls(waiting=bool(d["waiting"]), idle_s=float(d["idle_s"]), finished=bool(d["finished"]),
                       op=str(d.get("op", ""))[:500])
        except (ValueError, KeyError, TypeError):
            return None


def hung(mine: Status, everyone: list[Status | None], stall_s: float) -> bool:
    """Should this rank report a hang? Only when it waits, and so does every other unfinished rank,
    none having issued or completed an op for the stall window. A rank not heard from yet (still
    starting) counts as working; a rank that finished counts as waiting for nothing."""
    if not mine.waiting or mine.idle_s < stall_s:
        return False
    for s in everyone:
        if s is None:
            return False
        if not s.finished and (not s.waiting or s.idle_s < stall_s):
            return False
    return True


# ---- the flight recorder --------------------------------------------------------------------------

def _live_entries() -> list[dict]:
    """This process's flight-recorder entries (every NCCL group), oldest first; [] where there is none."""
    import torch
    c10d = torch._C._distributed_c10d
    as_json = getattr(c10d, "_dump_nccl_trace_json", None)
    if as_json is not None:
        try:
            return list(json.loads(as_json(includeCollectives=True, onlyActive=False)).get("entries", []))
        except Exception:  # noqa: BLE001 - fall through to the pickled form
            pass
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return []
    return list(pickle.loads(dump(includeCollectives=True, includeStackTraces=False,
                                  onlyActive=False)).get("entries", []))


def _live_frames(record_id: int) -> list[dict]:
    """The Python frames that issued one entry (asked once, when a hang is reported: symbolising is slow)."""
    import torch
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return []
    try:
        entries = pickle.loads(dump(includeCollectives=True, includeStackTraces=True, onlyActive=True))["entries"]
    except Exception:  # noqa: BLE001 - the report goes out without the line
        return []
    return next((e.get("frames") or [] for e in entries if e.get("record_id") == record_id), [])


def incomplete(entries: list[dict]) -> list[dict]:
    """The entries whose op has not completed (and was not retired by an abort), oldest first."""
    return [e for e in entries if e.get("state") != "completed" and not e.get("retired")]


_ENGINE = (os.sep + "torch" + os.sep, os.sep + "distlab" + os.sep + "engine" + os.sep,
           os.sep + "multiprocessing" + os.sep)


def issued_at(frames: list[dict]) -> str:
    """'fn (file:line)' of the innermost frame that is not torch's or the launcher's (the flight
    recorder lists the innermost frame first); '' when there is none."""
    for f in frames:
        path = str(f.get("filename", ""))
        if path and not any(e in path for e in _ENGINE):
            return f"{f.get('name', '?')} ({path}:{f.get('line', '?')})"
    return ""


def describe(entry: dict, frames: list[dict] | None = None) -> str:
    """'all_reduce #3 (inputs [[1]], group default_pg) issued at fn (file:line)'."""
    name = str(entry.get("profiling_name", "an op")).split(":", 1)[-1]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") or name.startswith(("send", "recv")) else \
        entry.get("collective_seq_id")
    group = entry.get("process_group")
    group = group[1] or group[0] if isinstance(group, (list, tuple)) and len(group) == 2 else group
    text = f"{name} #{seq} (inputs {entry.get('input_sizes', '?')}, group {group})"
    where = issued_at(frames if frames is not None else entry.get("frames") or [])
    return text + (f" issued at {where}" if where else "")


# ---- the watch: one thread per NCCL rank -----------------------------------------------------------

class HangWatch:
    """Reads the flight recorder every `period_s`, publishes this rank's `Status` under
    `distlab/watch/<rank>` in `store` (and in `note_path`), and calls `report(message)` once: when
    `hung(...)` holds, or when an op is about to reach NCCL's `timeout_s`. `read` returns the
    flight-recorder entries; `frames_of(record_id)` the frames of one (both replaceable in tests)."""

    def __init__(self, rank: int, world_size: int, store: Any, stall_s: float, timeout_s: float,
                 report: Callable[[str], None], *, read: Callable[[], list[dict]] | None = None,
                 frames_of: Callable[[int], list[dict]] | None = None, note_path: str | None = None,
                 period_s: float = PERIOD_S) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.stall_s, self.timeout_s, self.report = stall_s, timeout_s, report
        self.read, self.frames_of = read or _live_entries, frames_of or _live_frames
        self.note_path, self.period_s = note_path, period_s
        self._token: Any = None
        self._since = time.monotonic()          # when this rank last issued or completed an op
        self._first_seen: dict[Any, float] = {}  # record id -> when the watch first saw it incomplete
        self._finished = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reported = ""

    def status(self, now: float) -> tuple[Status, dict | None]:
        """This rank's status now, and its oldest incomplete entry."""
        try:
            entries = self.read()
        except Exception:  # noqa: BLE001 - no recorder: this rank never counts as waiting
            entries = []
        open_ = incomplete(entries)
        token = (max((e.get("record_id", -1) for e in entries), default=-1),
                 tuple(e.get("record_id") for e in open_))
        if token != self._token:
            self._token, self._since = token, now
        ids = {e.get("record_id") for e in open_}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in ids}
        for e in open_:
            self._first_seen.setdefault(e.get("record_id"), now)
        oldest = open_[0] if open_ else None
        return Status(waiting=bool(open_) and not self._finished, idle_s=now - self._since,
                      finished=self._finished, op=describe(oldest) if oldest else ""), oldest

    def _others(self) -> list[Status | None]:
        out: list[Status | None] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = _KEY.format(r)
            try:
                out.append(Status.parse(self.store.get(key)) if self.store.check([key]) else None)
            except Exception:  # noqa: BLE001 - the store is gone: the launch is ending
                out.append(None)
        return out

    def poll(self, now: float | None = None) -> str:
        """One round: publish, compare, and report if it is time. Returns the report ('' if none)."""
        now = time.monotonic() if now is None else now
        mine, oldest = self.status(now)
        try:
            self.store.set(_KEY.format(self.rank), mine.line())
        except Exception:  # noqa: BLE001
            pass
        if self.note_path:
            with open(self.note_path, "w") as f:
                f.write(mine.line())
        if self.reported or oldest is None or self._finished:
            return ""
        age = now - self._first_seen[oldest.get("record_id")]
        message = ""
        if hung(mine, self._others(), self.stall_s):
            message = (f"did not complete within the stall window ({self.stall_s:g} s): every unfinished rank "
                       "waited for an op of its own and none issued or completed one in that time (NCCL's "
                       "flight recorder). A peer never joined it: a collective some ranks skip, a recv "
                       "without its send, ranks issuing ops in different orders.")
        elif age >= self.timeout_s - REPORT_EARLY_S:
            message = (f"waited {age:.0f} s and NCCL's timeout ({self.timeout_s:g} s) was about to abort the "
                       "rank. A peer never joined it, or took longer than that to reach it: if one rank "
                       "is only slow (a long set-up before its first collective), set DISTLAB_NCCL_TIMEOUT_S "
                       "higher.")
        if message:
            where = self.frames_of(oldest.get("record_id", -1))
            self.reported = f"rank {self.rank}: {describe(oldest, where or None)} {message}"
            self.report(self.reported)
        return self.reported

    def finish(self) -> None:
        """The rank's function returned and its GPU work completed: it waits for nothing now."""
        self._finished = True
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a watch must never take a rank down
                pass

    def start(self) -> "HangWatch":
        self._thread = threading.Thread(target=self._run, name="distlab-hangwatch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)


# ---- recognising NCCL's watchdog after a rank died ---------------------------------------------------

# What releases of PyTorch have printed when the watchdog times an op out (fallback only).
_WATCHDOG_TEXT = re.compile(r"watchdog caught collective operation timeout|collective operation timeout"
                            r"|WorkNCCL\(.*Timeout\(ms\)|ran for \d+ milliseconds before timing out"
                            r"|watchdog.*timed out|timed out.*WorkNCCL", re.IGNORECASE)
_MAX_DUMP_BYTES = 16 * 2 ** 20
_SAFE_GLOBALS = {("torch.jit._pickle", n) for n in ("build_intlist", "build_doublelist", "build_boollist",
                                                     "build_tensorlist", "build_generic_list")}


class _DataOnly(pickle.Unpickler):
    """Plain data only: dicts, lists, tuples, strings, numbers, and the JIT pickler's typed lists.
    A rank's dump is read in the launcher, and learner code may have written anything there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return list
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def read_dump(path: str) -> dict | None:
    """A flight-recorder dump file, read as data (None if absent, too big, or not plain data)."""
    try:
        if os.path.getsize(path) > _MAX_DUMP_BYTES:
            return None
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    try:
        data = json.loads(blob)
    except ValueError:
        try:
            data = _DataOnly(io.BytesIO(blob)).load()
        except Exception:  # noqa: BLE001 - malformed, truncated or hostile: not evidence
            return None
    return data if isinstance(data, dict) else None


def _aborted(exitcode: int | None) -> bool:
    """Did the process end by SIGABRT (what NCCL's watchdog does to a rank after a timeout)?"""
    return exitcode in (-signal.SIGABRT, 128 + signal.SIGABRT)


def abort_reason(workdir: str, r: int, exitcode: int | None) -> str:
    """One line when rank `r` of the launch in `workdir` was stopped by NCCL's watchdog, naming the op;
    '' otherwise. Evidence in order of trust: the flight recorder's dump (written on a timeout), the
    watch's last status together with an abort signal, and only then the text NCCL printed."""
    for path in sorted(glob.glob(os.path.join(workdir, f"{DUMP_PREFIX}{r}")) +
                       glob.glob(os.path.join(workdir, f"{DUMP_PREFIX}{r}_*")))[:4]:
        dump = read_dump(path)
        entries = [e for e in (dump or {}).get("entries", []) if isinstance(e, dict)]
        pending = incomplete(entries)
        if pending:
            return f"rank {r}: NCCL's watchdog timed out {describe(pending[0])} (its flight recorder's dump)"
    try:
        with open(os.path.join(workdir, f"rank{r}.watch")) as f:
            status = Status.parse(f.read(4096))
    except OSError:
        status = None
    if _aborted(exitcode) and status is not None and status.waiting:
        return (f"rank {r}: aborted (SIGABRT, as NCCL's watchdog aborts a rank) after waiting "
                f"{status.idle_s:.0f} s for {status.op or 'an op'}")
    try:
        with open(os.path.join(workdir, f"rank{r}.errlog"), errors="replace") as f:
            for line in f.read(2 * 2 ** 20).splitlines():
                if _WATCHDOG_TEXT.search(line):
                    return f"rank {r}: NCCL's watchdog: {line.strip()[:400]}"
    except OSError:
        pass
    return ""
