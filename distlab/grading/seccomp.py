"""A seccomp filter for a graded rank: no new sockets, processes, sessions or process groups.

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
- every x32 system call (on x86-64).

What already exists keeps working: gloo's own threads were started before the
filter (they hold its sockets and are not filtered), the store's connection
is open, and a process group the learner creates later is built by the audit
hook's group thread (`distlab.grading.audithook`), started before the filter.
`available()` says whether this machine can install it (Linux on x86-64 or
aarch64); where it cannot, `confine` does nothing and says so on stderr.
"""
from __future__ import annotations

import ctypes
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38
CLONE_THREAD = 0x00010000
X32_BIT = 0x40000000

# BPF opcodes
LD_W_ABS = 0x20        # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15           # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35           # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45          # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06           # BPF_RET | BPF_K
# offsets in struct seccomp_data
NR, ARCH, ARG0 = 0, 4, 16

ARCHES = {
    # machine: (AUDIT_ARCH_*, seccomp syscall number, {name: number})
    "x86_64": (0xC000003E, 317, {
        "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "socketpair": 53, "accept4": 288,
        "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone3": 435,
        "setsid": 112, "setpgid": 109, "ptrace": 101, "unshare": 272, "setns": 308}),
    "aarch64": (0xC00000B7, 277, {
        "socket": 198, "socketpair": 199, "bind": 200, "listen": 201, "accept": 202, "connect": 203,
        "accept4": 242, "clone": 220, "execve": 221, "execveat": 281, "clone3": 435,
        "setsid": 157, "setpgid": 154, "ptrace": 117, "unshare": 97, "setns": 268}),
}
SOCKET_CALLS = ("socket", "socketpair", "bind", "listen", "connect", "accept", "accept4")
PROCESS_CALLS = ("fork", "vfork", "execve", "execveat", "setsid", "setpgid", "ptrace", "unshare", "setns")


def available() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ARCHES


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def program(machine: str | None = None, sockets: bool = True) -> bytes:
    """The filter as `struct sock_filter` instructions (8 bytes each)."""
    arch, _, calls = ARCHES[machine or platform.machine()]
    denied = [calls[n] for n in (SOCKET_CALLS if sockets else ()) + PROCESS_CALLS if n in calls]
    ret_allow, ret_eperm = _ins(RET_K, SECCOMP_RET_ALLOW), _ins(RET_K, SECCOMP_RET_ERRNO | EPERM)
    ret_enosys = _ins(RET_K, SECCOMP_RET_ERRNO | ENOSYS)
    # Layout: [arch check][load nr][x32 check][deny list][clone][clone3][allow][eperm][enosys][clone flags...]
    body: list[bytes] = []
    n_deny = len(denied)
    # After the deny list: 0 clone-jeq, 1 clone3-jeq, 2 allow, 3 eperm, 4 enosys, 5 ld arg0, 6 jset, 7 allow, 8 eperm
    for i, nr in enumerate(denied):
        to_eperm = (n_deny - 1 - i) + 3      # skip the rest of the list, the clone/clone3 jumps and allow
        body.append(_ins(JEQ_K, nr, to_eperm, 0))
    body.append(_ins(JEQ_K, calls["clone"], 4, 0))          # -> ld arg0
    body.append(_ins(JEQ_K, calls["clone3"], 2, 0))         # -> enosys
    body += [ret_allow, ret_eperm, ret_enosys]
    body += [_ins(LD_W_ABS, ARG0), _ins(JSET_K, CLONE_THREAD, 0, 1), ret_allow, ret_eperm]
    head = [_ins(LD_W_ABS, ARCH), _ins(JEQ_K, arch, 1, 0), ret_eperm, _ins(LD_W_ABS, NR)]
    if arch == ARCHES["x86_64"][0]:
        head.append(_ins(JGE_K, X32_BIT, 0, 1))
        head.append(ret_eperm)
    return b"".join(head + body)


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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
