"""Stopping process trees, and telling a busy process from a stuck one.

One helper for everything that starts processes: the launcher (ranks), the
grader (workers, sandboxes) and the cluster export (torchrun agents).
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

import psutil

GRACE_S = 1.0


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes `pids` and all their descendants that still exist."""
    out: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            out += root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            pass
    return out


def kill_tree(pids: Iterable[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM `pids` and their descendants, wait `grace_s`, then SIGKILL what is left."""
    victims = tree(pids)
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def kill_until_gone(find: Callable[[], list[psutil.Process]],
                    after_round: Callable[[], None] | None = None, rounds: int = 20) -> None:
    """SIGKILL what `find()` returns, round after round, until it returns nothing.

    For trees that may fork while being killed (a learner's fork bomb, a daemon).
    """
    for _ in range(rounds):
        procs = find()
        if not procs:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=2)
        if after_round is not None:
            after_round()


def reap_orphans() -> None:
    """Collect the exit status of any finished child (orphans re-parented to a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def become_subreaper() -> bool:
    """Orphans below this process are re-parented here instead of to init (Linux)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def runnable(p: psutil.Process) -> bool:
    """Whether some thread of `p` is runnable now (state R). The process's own state is its main thread's:
    a rank whose main thread waits on gloo's worker while that worker waits for a core reads S, and on a
    machine with one core for many ranks its share stays under `min_share` (a busy ring was reported hung
    so, with the suite pinned to one core)."""
    try:
        tids = os.listdir(f"/proc/{p.pid}/task")
    except OSError:   # no /proc (macOS): the process's state
        return p.status() == psutil.STATUS_RUNNING
    for tid in tids:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                # "tid (comm) S ...": the state follows the last ')', as comm may hold either parenthesis
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    return True
        except (OSError, IndexError):
            continue
    return False


class ProgressMonitor:
    """Says whether a group of processes did any work since the last look.

    A process computing or moving bytes burns CPU time; one blocked in a
    collective its peers never join sleeps and burns almost none (measured
    here: 0.01 s of CPU per 2 s, 0.5% of a core, for a rank blocked in
    `recv`). So: a look at least `interval_s` after the previous one finds
    work when some process of the tree used more than `min_share` of a core
    since then, or has a thread runnable now (state R: starved of CPU on a
    busy machine is not stuck). No work on every look for a whole stall window
    means stuck, however slow the machine is. `cpu_s[pid]` is the CPU time the
    tree of each watched process had used at the latest look (the launcher's
    work cap, for a livelock: busy, never done).
    """

    def __init__(self, min_share: float = 0.05, interval_s: float = 1.0) -> None:
        self.min_share, self.interval_s = min_share, interval_s
        self._cpu: dict[int, float] = {}
        self._at = 0.0
        self._verdict = True
        self.cpu_s: dict[int, float] = {}   # CPU seconds each watched root process (and its tree) has used

    def busy(self, pids: Iterable[int], now: float) -> bool:
        """Work seen at the latest look (looks closer than `interval_s` repeat the last answer)."""
        if now - self._at < self.interval_s:
            return self._verdict
        elapsed, self._at = now - self._at, now
        busy = False
        cpu: dict[int, float] = {}
        for root in pids:
            self.cpu_s[root] = 0.0
            for p in tree([root]):
                try:
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
                    running = runnable(p)
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue
                self.cpu_s[root] += cpu[p.pid]
                before = self._cpu.get(p.pid)
                if running or before is None or (cpu[p.pid] - before) / elapsed >= self.min_share:
                    busy = True
        self._cpu, self._verdict = cpu, busy
        return busy
