"""A seccomp filter for a graded rank: no new sockets, processes or sessions, no signals to other processes.

`confine()` runs on a rank's main thread once its process group is up and
before any learner code. It sets `PR_SET_NO_NEW_PRIVS` and installs a small
hand-assembled BPF program (`program()`) with `seccomp(SECCOMP_SET_MODE_FILTER)`
for this thread; every thread and process started from it afterwards inherits
it, and it can never be removed. The kernel then answers EPERM to:

- socket, socketpair, bind, listen, connect, accept, accept4 (`sockets=True`: gloo;
  NCCL opens sockets as it goes, so under NCCL these stay open);
- fork, vfork, and clone without CLONE_THREAD (threads are allowed); clone3 gets
  ENOSYS, so the C library falls back to clone, whose flags the filter can read;
- execve, execveat, setsid, setpgid, ptrace, unshare, setns;
- signals to any other process: kill, tgkill, rt_sigqueueinfo and rt_tgsigqueueinfo pass only
  with this process's own pid as their target (its threads included); tkill, pidfd_open and
  pidfd_send_signal never; fcntl F_SETOWN/F_SETOWN_EX/F_SETSIG and ioctl FIOSETOWN/SIOCSPGRP
  (SIGIO sent to another process) never. The runner and the grader cannot be stopped or killed;
- process_vm_readv/writev and pidfd_getfd (another rank's memory or files), io_uring_setup,
  io_uring_enter and io_uring_register (system calls the filter could not see);
- prctl(PR_SET_DUMPABLE): a rank is made non-dumpable before any learner code (`no_dump`), so a sibling
  rank (same uid, no CAP_SYS_PTRACE) cannot open its files through /proc/<pid>/fd (its pipes to its
  broker, its event stream) nor read its memory; the filter keeps it so;
- every x32 system call (on x86-64).

What already exists keeps working: the store's connection is open, the
pipes to the rank's broker (`distlab.grading.broker`) are open, and every
gloo group, the learner's later ones included, is built by that broker, a
process outside the filter (under NCCL, sockets stay open).
`available()` says whether this machine can install it (Linux on x86-64 or
aarch64); where it cannot, `confine` does nothing and says so on stderr.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_DUMPABLE = 4
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
CLONE_THREAD = 0x00010000
X32_BIT = 0x40000000
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902

# BPF opcodes
LD_W_ABS = 0x20        # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15           # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35           # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45          # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06           # BPF_RET | BPF_K
# offsets in struct seccomp_data (little-endian: an argument's low word first)
NR, ARCH, ARG0, ARG1 = 0, 4, 16, 24

ARCHES = {
    # machine: (AUDIT_ARCH_*, seccomp syscall number, {name: number})
    "x86_64": (0xC000003E, 317, {
        "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "socketpair": 53, "accept4": 288,
        "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone3": 435,
        "setsid": 112, "setpgid": 109, "ptrace": 101, "unshare": 272, "setns": 308,
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "process_vm_readv": 310,
        "process_vm_writev": 311, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "fcntl": 72, "ioctl": 16, "prctl": 157}),
    "aarch64": (0xC00000B7, 277, {
        "socket": 198, "socketpair": 199, "bind": 200, "listen": 201, "accept": 202, "connect": 203,
        "accept4": 242, "clone": 220, "execve": 221, "execveat": 281, "clone3": 435,
        "setsid": 157, "setpgid": 154, "ptrace": 117, "unshare": 97, "setns": 268,
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "process_vm_readv": 270,
        "process_vm_writev": 271, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "fcntl": 25, "ioctl": 29, "prctl": 167}),
}
SOCKET_CALLS = ("socket", "socketpair", "bind", "listen", "connect", "accept", "accept4")
PROCESS_CALLS = ("fork", "vfork", "execve", "execveat", "setsid", "setpgid", "ptrace", "unshare", "setns",
                 "tkill", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "process_vm_readv", "process_vm_writev",
                 "io_uring_setup", "io_uring_enter", "io_uring_register")
OWN_PID_CALLS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")    # first argument: the target pid


def available() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ARCHES


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _assemble(items: list) -> bytes:
    """Instructions with symbolic jumps: ("jeq", k, true_label, false_label) (None: the next one), ("label", x)."""
    labels, n = {}, 0
    for it in items:
        if it[0] == "label":
            labels[it[1]] = n
        else:
            n += 1
    out, pc = [], 0
    for it in items:
        if it[0] == "label":
            continue
        if it[0] in (JEQ_K, JGE_K, JSET_K):
            code, k, yes, no = it
            off = [0 if t is None else labels[t] - pc - 1 for t in (yes, no)]
            out.append(_ins(code, k, off[0], off[1]))
        else:
            out.append(_ins(it[0], it[1]))
        pc += 1
    return b"".join(out)


def program(machine: str | None = None, sockets: bool = True, pid: int | None = None) -> bytes:
    """The filter as `struct sock_filter` instructions (8 bytes each); `pid`: the only target of a signal."""
    arch, _, calls = ARCHES[machine or platform.machine()]
    pid = os.getpid() if pid is None else pid
    denied = [calls[n] for n in (SOCKET_CALLS if sockets else ()) + PROCESS_CALLS if n in calls]
    items: list = [(LD_W_ABS, ARCH), (JEQ_K, arch, None, "eperm"), (LD_W_ABS, NR)]
    if arch == ARCHES["x86_64"][0]:
        items.append((JGE_K, X32_BIT, "eperm", None))
    items += [(JEQ_K, nr, "eperm", None) for nr in denied]
    items += [(JEQ_K, calls["clone"], "clone", None), (JEQ_K, calls["clone3"], "enosys", None)]
    items += [(JEQ_K, calls[n], "own_pid", None) for n in OWN_PID_CALLS]
    items += [(JEQ_K, calls["fcntl"], "fcntl", None), (JEQ_K, calls["ioctl"], "ioctl", None),
              (JEQ_K, calls["prctl"], "prctl", None), (RET_K, SECCOMP_RET_ALLOW)]
    items += [("label", "clone"), (LD_W_ABS, ARG0), (JSET_K, CLONE_THREAD, "allow", "eperm")]
    items += [("label", "own_pid"), (LD_W_ABS, ARG0 + 4), (JEQ_K, 0, None, "eperm"), (LD_W_ABS, ARG0),
              (JEQ_K, pid, "allow", "eperm")]
    items += [("label", "fcntl"), (LD_W_ABS, ARG1)] + [(JEQ_K, c, "eperm", None) for c in (F_SETOWN, F_SETSIG,
                                                                                          F_SETOWN_EX)]
    items += [(RET_K, SECCOMP_RET_ALLOW), ("label", "prctl"), (LD_W_ABS, ARG0), (JEQ_K, PR_SET_DUMPABLE, "eperm", "allow")]
    items += [("label", "ioctl"), (LD_W_ABS, ARG1), (JEQ_K, FIOSETOWN, "eperm", None),
              (JEQ_K, SIOCSPGRP, "eperm", None)]
    items += [("label", "allow"), (RET_K, SECCOMP_RET_ALLOW), ("label", "eperm"), (RET_K, SECCOMP_RET_ERRNO | EPERM),
              ("label", "enosys"), (RET_K, SECCOMP_RET_ERRNO | ENOSYS)]
    return _assemble(items)


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def no_dump() -> None:
    """prctl(PR_SET_DUMPABLE, 0): this process's /proc/<pid>/fd, mem and environ, and ptrace, closed to every
    process of the same uid without CAP_SYS_PTRACE (a rank, the runner's other children). Its children inherit it;
    the grader, outside the sandbox's user namespace, keeps reading /proc/<pid>/root and statm."""
    if sys.platform.startswith("linux"):
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def confine(sockets: bool = True) -> bool:
    """Install the filter on this thread (see the module docstring); False where it cannot be."""
    if not available():
        print("distlab grade: no seccomp filter on this platform (sockets and processes are only audited)",
              file=sys.stderr)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    code = program(sockets=sockets)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    nr = ARCHES[platform.machine()][1]
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(0),
                    ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER) failed")
    return True
