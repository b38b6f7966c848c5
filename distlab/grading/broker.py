"""The broker: a trusted process per graded rank that owns the rank's real (gloo) process groups.

The runner starts one broker per rank of a case (`start`), from its fork
server and before the ranks, with `prctl(PR_SET_DUMPABLE, 0)` as its first
act: a rank (same uid, under its seccomp filter: no ptrace, no
process_vm_readv, no signals to other processes, no sockets) can neither read
its memory nor stop it. The brokers of a case meet through a TCP store the
runner holds and build the real gloo groups among themselves.

A rank reaches its broker through two FIFOs only (requests, replies), which
the broker unlinks once the rank has opened them. Its `MeteredGroup` (see
`distlab.grading.pgmeter`) forwards every collective and point-to-point call
through the audit hook to `Client.issue`: the op's name, its group, its
arguments as JSON and its tensors' bytes. The broker rebuilds the tensors,
runs the op on the real group, books its algorithmic bytes (`pgmeter.algorithmic_bytes_booker`,
the bytes `track_comm` counts) and answers with a handle; `BrokerWork.wait`
fetches the op's outputs (its first argument) and copies them into the rank's
tensors. `track_comm` blocks are marked in the same pipe, in order
(`Client.region`).

What the broker books it writes, line by line, to a pipe only the runner
reads: `kind K` the first time the rank runs an op of kind K, `region begin
k`, and at a region's end `region end k CALLS BYTES` (JSON: kind -> calls,
kind -> bytes sent in it, nested regions each counting their ops), `pg group
size rank`, `ev what`, `end`: that is the case's traffic. Nothing in the rank can forge it: a
rank that writes its own requests into the pipe only runs (and is booked for)
real ops. Requests are never unpickled: JSON and raw bytes, checked here.
"""
from __future__ import annotations

import json
import os
import struct
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_HEAD = struct.Struct(">II")      # JSON length, number of tensors
_LEN = struct.Struct(">Q")
MAX_JSON = 1 << 20
# c10d option classes a call may carry, and the fields that cross the pipe
OPTION_FIELDS = ("asyncOp", "reduceOp", "rootRank", "rootTensor", "timeout", "device_ids")
ALIASES = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
           "all_to_all_single": "alltoall_base", "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
           "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced"}
ONE_BY_ONE = {"allgather_into_tensor_coalesced": "_allgather_base",
              "reduce_scatter_tensor_coalesced": "_reduce_scatter_base"}


# -- framing: both directions ------------------------------------------------------------------------------
def read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send_msg(fd: int, head: dict, blobs: list[bytes] = ()) -> None:
    text = json.dumps(head, separators=(",", ":")).encode()
    parts = [_HEAD.pack(len(text), len(blobs)), text]
    for b in blobs:
        parts += [_LEN.pack(len(b)), b]
    _write_all(fd, b"".join(parts))


def recv_msg(fd: int, max_bytes: int = 8 << 30) -> tuple[dict, list[bytes]]:
    n_json, n_blobs = _HEAD.unpack(read_exact(fd, _HEAD.size))
    if n_json > MAX_JSON or n_blobs > 65536:
        raise ValueError("a request too large")
    head = json.loads(read_exact(fd, n_json))
    blobs = []
    for _ in range(n_blobs):
        (size,) = _LEN.unpack(read_exact(fd, _LEN.size))
        if size > max_bytes:
            raise ValueError("a tensor too large")
        blobs.append(read_exact(fd, size))
    if type(head) is not dict:
        raise ValueError("a request that is not an object")
    return head, blobs


# -- tensors and call arguments ------------------------------------------------------------------------------
def tensor_bytes(t: Any) -> bytes:
    """A tensor's bytes, read with `TensorBase`'s own methods (a subclass's Python overrides never run)."""
    base = torch._C.TensorBase
    flat = base.reshape(base.contiguous(base.detach(t)), (-1,))
    return base.numpy(base.view(flat, torch.uint8)).tobytes() if base.numel(flat) else b""


def tensor_meta(t: Any) -> tuple[str, list[int]]:
    base = torch._C.TensorBase
    return str(base.dtype.__get__(t)).removeprefix("torch."), [int(s) for s in base.size(t)]


def tensor_from(blob: bytes, dtype: str, shape: list[int]) -> Any:
    dt = getattr(torch, dtype)
    if type(dt) is not torch.dtype:
        raise TypeError(f"not a dtype: {dtype}")
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    return raw.view(dt).reshape([int(s) for s in shape])


def encode_call(call: tuple, tensor_type: type, c10d: Any) -> tuple[Any, list[bytes]]:
    """The arguments of a ProcessGroup call as JSON (tensors as {"T": i}, options as {"O": name, "f": ...}) and
    the tensors' bytes. Only plain values, lists, tensors and c10d options pass (the hook has checked)."""
    blobs: list[bytes] = []
    reduce_op = dist.ReduceOp

    def enc(x: Any) -> Any:
        t = type(x)
        if x is None or t in (bool, int, float, str):
            return x
        if t in (list, tuple):
            return {"L": [enc(v) for v in x]}
        if tensor_type in t.__mro__:
            blobs.append(tensor_bytes(x))
            dtype, shape = tensor_meta(x)
            return {"T": len(blobs) - 1, "d": dtype, "s": shape}
        if t is timedelta:
            return {"S": x.total_seconds()}
        if t is reduce_op:
            return {"R": int(x.op)}
        if t.__name__.endswith("Options") and getattr(c10d, t.__name__, None) is t:
            return {"O": t.__name__, "f": {f: enc(getattr(x, f)) for f in OPTION_FIELDS if hasattr(t, f)}}
        raise TypeError("distlab grade: a process-group call got a " + t.__name__)
    return enc(call), blobs


def decode_call(obj: Any, blobs: list[bytes]) -> Any:
    """The broker's side of `encode_call`: real tensors and option objects again."""
    c10d = torch._C._distributed_c10d

    def dec(x: Any, depth: int = 0) -> Any:
        if depth > 8:
            raise ValueError("nested too deep")
        t = type(x)
        if x is None or t in (bool, int, float, str):
            return x
        if t is not dict:
            raise ValueError("a malformed argument")
        if "L" in x:
            return [dec(v, depth + 1) for v in x["L"]]
        if "T" in x:
            return tensor_from(blobs[int(x["T"])], str(x["d"]), x["s"])
        if "S" in x:
            return timedelta(seconds=float(x["S"]))
        if "R" in x:
            ops = {int(v): v for v in dist.ReduceOp.RedOpType.__members__.values()}
            return dist.ReduceOp(ops[int(x["R"])])
        if "O" in x:
            cls = getattr(c10d, str(x["O"]), None)
            if not (isinstance(cls, type) and cls.__name__.endswith("Options")):
                raise ValueError("not an option class")
            opts = cls()
            for field, value in x["f"].items():
                if field in OPTION_FIELDS:
                    setattr(opts, field, dec(value, depth + 1))
            return opts
        raise ValueError("a malformed argument")
    return dec(obj)


def flat_tensors(x: Any, tensor_type: type) -> list[Any]:
    """The tensors of `x` (a tensor or nested lists of them), in order."""
    if tensor_type in type(x).__mro__:
        return [x]
    if type(x) in (list, tuple):
        return [t for v in x for t in flat_tensors(v, tensor_type)]
    return []


# -- the broker process -------------------------------------------------------------------------------------
def serve(rank: int, port: int, req_path: str, rep_path: str, log: Any) -> None:
    """The broker of one rank: serve its requests until the rank closes its pipe. `log`: the runner's pipe."""
    from distlab.grading.seccomp import no_dump
    no_dump()
    out = log.fileno()

    def note(*fields: Any) -> None:
        _write_all(out, ("\t".join(str(f).replace("\t", " ").replace("\n", " ") for f in fields) + "\n").encode())

    try:
        req = os.open(req_path, os.O_RDONLY)
        rep = os.open(rep_path, os.O_WRONLY)
        for path in (req_path, rep_path):     # opened by both ends: no other process may open them now
            os.unlink(path)
        _Broker(rank, port, req, rep, note).run()
    except (EOFError, BrokenPipeError):
        pass        # the rank closed its pipes or was stopped (a hung case): nothing more to book
    except BaseException as exc:  # noqa: BLE001 - the runner reads it as evidence
        note("ev", "broker", f"the rank's requests were malformed ({type(exc).__name__}: {exc})"[:300])
    note("end")
    os._exit(0)


class _Broker:
    def __init__(self, rank: int, port: int, req: int, rep: int, note: Any) -> None:
        from distlab.grading.pgmeter import OP_KINDS, algorithmic_bytes_booker
        base = torch._C.TensorBase
        self.book = algorithmic_bytes_booker(base.numel, base.element_size, base.dim, base.size)
        self.kinds = dict(OP_KINDS)
        self.rank, self.req, self.rep, self.note = rank, req, rep, note
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        self.groups: dict[str, tuple] = {}
        self.works: dict[int, tuple] = {}
        self.issued = 0
        self.regions: set[tuple[str, int]] = set()
        self.open: dict[int, tuple[dict, dict]] = {}
        self.kinds_seen: set[str] = set()

    def run(self) -> None:
        while True:
            head, blobs = recv_msg(self.req)
            do = head.get("do")
            if do == "region":
                self.region(str(head["edge"]), int(head["k"]))
                continue
            try:
                reply, out = getattr(self, "do_" + str(do))(head, blobs) if do in ("create", "op", "wait", "sync") \
                    else ({"ok": False, "err": "ValueError", "msg": f"unknown request {do!r}"}, [])
            except (TypeError, ValueError, RuntimeError, IndexError, KeyError, NotImplementedError) as exc:
                reply, out = {"ok": False, "err": type(exc).__name__, "msg": str(exc)[:2000]}, []
            send_msg(self.rep, reply, out)

    def region(self, edge: str, k: int) -> None:
        if edge not in ("begin", "end") or (edge, k) in self.regions or (edge == "end" and ("begin", k)
                                                                         not in self.regions):
            self.note("ev", "region", f"a traffic region marker the check did not send ({edge} {k})")
            return
        self.regions.add((edge, k))
        if edge == "begin":
            self.open[k] = ({}, {})
            self.note("region", edge, k)
        else:
            calls, sent = self.open.pop(k)
            self.note("region", edge, k, json.dumps(calls), json.dumps(sent))

    def do_create(self, head: dict, blobs: list) -> tuple[dict, list]:
        gid, rank, size = str(head["g"]), int(head["rank"]), int(head["size"])
        if gid in self.groups or not 0 <= rank < size:
            raise ValueError(f"group {gid!r} already exists or rank {rank} of {size}")
        store = dist.PrefixStore(f"g/{gid}/", self.store)
        pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=float(head["timeout"])))
        self.groups[gid] = (pg, size, rank)
        self.note("pg", gid, size, rank)
        return {"ok": True}, []

    def do_op(self, head: dict, blobs: list) -> tuple[dict, list]:
        name = str(head["name"])
        pg, size, rank = self.groups[str(head["g"])]
        if name not in self.kinds:
            raise ValueError(f"not a collective: {name}")
        call = tuple(decode_call(head["args"], blobs))
        kind, nbytes = self.book(name, call, size, rank)
        work = self._forward(pg, ALIASES.get(name, name), call)
        # booked once issued: a refused call moved nothing
        if kind not in self.kinds_seen:
            self.kinds_seen.add(kind)
            self.note("kind", kind)
        for calls, sent in self.open.values():
            calls[kind] = calls.get(kind, 0) + 1
            sent[kind] = sent.get(kind, 0) + nbytes
        self.issued += 1
        handle = self.issued
        self.works[handle] = (work, call[0] if call else None, name)
        return {"ok": True, "h": handle}, []

    def _forward(self, pg: Any, name: str, call: tuple) -> Any:
        if hasattr(pg, name) or name not in ONE_BY_ONE:
            return getattr(pg, name)(*call)
        outputs, inputs = call[0], call[1]
        single = getattr(pg, ONE_BY_ONE[name])
        works = [single(o, i, *call[2:3]) for o, i in zip(outputs, inputs)]
        if not works:
            raise ValueError("distlab grade: a coalesced collective with no tensors")
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def do_sync(self, head: dict, blobs: list) -> tuple[dict, list]:
        """Answered once every earlier request is booked (the rank asks before it returns its outputs)."""
        return {"ok": True}, []

    def do_wait(self, head: dict, blobs: list) -> tuple[dict, list]:
        work, first, name = self.works.pop(int(head["h"]))
        work.wait()
        src = work.source_rank() if name == "recv_anysource" else None
        outs = [] if name in ("send", "barrier", "monitored_barrier") else flat_tensors(first, torch.Tensor)
        return {"ok": True, "src": src}, [tensor_bytes(t) for t in outs]


# -- the rank's side ----------------------------------------------------------------------------------------
class Client:
    """The rank's end of its broker's pipes (opened before learner code; one exchange at a time)."""

    def __init__(self, req_path: str, rep_path: str) -> None:
        import threading
        self.req = os.open(req_path, os.O_WRONLY)
        self.rep = os.open(rep_path, os.O_RDONLY)
        self.lock = threading.Lock()

    def ask(self, head: dict, blobs: list[bytes] = ()) -> tuple[dict, list[bytes]]:
        with self.lock:
            send_msg(self.req, head, blobs)
            reply, out = recv_msg(self.rep)
        if not reply.get("ok"):
            kind = {"TypeError": TypeError, "ValueError": ValueError, "IndexError": IndexError,
                    "NotImplementedError": NotImplementedError}.get(reply.get("err"), RuntimeError)
            raise kind(str(reply.get("msg", "the broker refused the call")))
        return reply, out

    def region(self, edge: str, k: int) -> None:
        with self.lock:
            send_msg(self.req, {"do": "region", "edge": edge, "k": k})

    def sync(self) -> None:
        self.ask({"do": "sync"})

    def create(self, gid: str, rank: int, size: int, timeout_s: float) -> None:
        self.ask({"do": "create", "g": gid, "rank": rank, "size": size, "timeout": timeout_s})

    def issue(self, gid: str, name: str, call: tuple, tensor_type: type, c10d: Any) -> Any:
        args, blobs = encode_call(call, tensor_type, c10d)
        reply, _ = self.ask({"do": "op", "g": gid, "name": name, "args": args}, blobs)
        first = call[0] if call and name not in ("send", "barrier", "monitored_barrier") else None
        return BrokerWork(self, int(reply["h"]), flat_tensors(first, tensor_type), first)


class BrokerWork(dist.Work):
    """An op the broker runs: `wait` fetches its outputs and copies them into the rank's tensors."""

    def __init__(self, client: Client, handle: int, outs: list, first: Any) -> None:
        super().__init__()
        self._client, self._handle, self._outs, self._first = client, handle, outs, first
        self._done, self._src = False, -1

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._done = True
            reply, blobs = self._client.ask({"do": "wait", "h": self._handle})
            if len(blobs) != len(self._outs):
                raise RuntimeError("distlab grade: the broker sent back the wrong number of tensors")
            with torch.no_grad(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                for dst, blob in zip(self._outs, blobs):
                    torch._C.TensorBase.copy_(dst, tensor_from(blob, *tensor_meta(dst)))
            self._src = reply.get("src") if type(reply.get("src")) is int else -1
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def source_rank(self) -> int:
        self.wait()
        return self._src

    def _source_rank(self) -> int:
        return self.source_rank()

    def result(self) -> list:
        self.wait()
        return self._outs

    def get_future(self) -> Any:
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._outs)
        return fut


# -- the runner's side --------------------------------------------------------------------------------------
class Brokers:
    """One broker per rank of a case, started from the runner's fork server before the ranks."""

    def __init__(self, folder: str, world_size: int) -> None:
        import torch.multiprocessing as tmp
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        self.paths = [(os.path.join(folder, f"req{r}"), os.path.join(folder, f"rep{r}")) for r in range(world_size)]
        ctx = tmp.get_context("forkserver")
        self.readers, self.procs = [], []
        for r, (req, rep) in enumerate(self.paths):
            os.mkfifo(req, 0o600)
            os.mkfifo(rep, 0o600)
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=serve, args=(r, self.store.port, req, rep, writer), name=f"distlab-broker{r}",
                            daemon=True)
            p.start()
            writer.close()
            self.readers.append(reader)
            self.procs.append(p)

    def fds(self) -> list[int]:
        return [r.fileno() for r in self.readers]

    def stop(self) -> None:
        """After the ranks: every rank synced with its broker before it returned (`Client.sync`), so all it
        booked for the outputs is in the pipe; the brokers are stopped at once (one may be stuck in a wait)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for (req, rep) in self.paths:       # a rank that never opened its end
            for path in (req, rep):
                if os.path.exists(path):
                    os.unlink(path)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        del self.store
