"""The audit hook a graded rank installs before any learner code: what learner code did, as it happens.

`install(stream_path, ...)` opens the rank's event stream (a FIFO the sandbox
runner reads) and adds a `sys.addaudithook` hook, which no Python code can
remove. From then on the hook writes one text line per record
(`distlab.grading.evidence` reads them) the moment something happens:

- `region`: `track_comm` blocks opened and closed (`learner` = 1 when learner
  code was on the stack, so its figures are not the check's); while a block is
  open, each op is also added to its meter's `calls` and `bytes` (a check may
  read them during the block: the dispatch mode that counts them outside
  grading sees no op of a Python process group);
- `ev`: events that learner code caused and an honest answer never needs:
  reading the stack or other objects' internals, replacing code, ctypes,
  processes, threads, signals, sockets, file access outside the Python
  environment and the package, `distlab.*` audit events not raised by distlab;
- `changed`: functions or classes of distlab / torch.distributed rebound
  between two checkpoints; `end`: the trusted code handed the outputs back;
- on NCCL only, `pg` and `op`: every call on a `MeteredGroup`, run by the hook
  on the real group it holds, and its algorithmic bytes.

On CPU (gloo) the real process groups are the rank's broker's
(`distlab.grading.broker`): the hook forwards each call there and holds no
group and no secret, so a rank that walks its own objects (gc, frames,
closures) finds nothing to bypass the broker with; what the broker books is
the rank's traffic (enforced). On NCCL the hook still owns the real groups:
traffic there is detected, not enforced.

Events that reach internals or the outside (gc walks, other threads' frames,
tracing, ctypes, processes, signals, sockets, code objects) are booked to the
learner whenever a learner frame is anywhere on the stack, so calling them
through a library function (`tree_map(gc.get_referrers, ...)`) hides nothing;
the rest (imports, reading library files, `sys._getframe`, which the library
does on the learner's behalf all the time) only when learner code caused them.
Each record is written, in one `write` of under PIPE_BUF bytes, before the
event's caller gets anything back: a walk is booked before it returns.

The stream is evidence the rank's own process writes, so it is detected, not
enforced: learner code can append lines to it (they can only add evidence;
see `evidence` for what is refused) or close it. Everything the hook uses is
bound here, before learner code runs, and kept in its closure: learner code
can rebind module attributes, but not these. Two routes that would hand the
hook's frames to learner code are closed:
- torch's frame-evaluation callback (`set_eval_frame`, what `torch.compile`
  installs; it would be handed the hook's own frame with no audit event):
  replaced before learner code by `set_eval_frame` below, which refuses a
  callback, and books the try;
- tracebacks: no exception ever leaves the hook. A failing call on the
  metered group (a gloo error, an argument the hook refuses) comes back to
  `MeteredGroup._op` as a `pgmeter.Failed`, which raises a fresh exception there.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from distlab.engine.libpaths import library_roots

# Events booked whenever learner code is anywhere on the stack (see the module docstring) ...
ANYWHERE = frozenset({
    "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__", "function.__new__", "os.system",
    "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn", "os.kill",
    "os.killpg", "signal.pthread_kill", "mmap.__new__", "resource.setrlimit", "resource.prlimit",
})
# ... and all those worth a record when learner code caused them. "open" is filtered by path and mode below.
WATCH = ANYWHERE | {
    "sys._getframe", "object.__setattr__", "object.__delattr__", "_thread.start_new_thread", "os.listdir",
    "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.utime", "os.chdir", "shutil.rmtree", "shutil.copyfile", "fcntl.ioctl", "open", "compile",
    "exec", "import", "object.__getattr__", "marshal.loads", "marshal.load",
}
PREFIXES = ("ctypes.", "socket.", "_posixsubprocess.")
# file-system events that are the rank's own business inside its temporary folder (`in_tmp`)
TMP_EVENTS = frozenset({"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir", "os.truncate",
                        "os.utime", "os.chmod", "shutil.rmtree"})
ANYWHERE_PREFIXES = ("ctypes.", "_posixsubprocess.", "socket.__new__", "socket.bind", "socket.connect",
                     "socket.sendto", "socket.sendmsg")
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_globals", "f_locals"})
# CPython's test modules reach interpreter internals (frames, eval hooks, memory) with no audit events of their
# own: importing one is booked whenever learner code is anywhere on the stack
TEST_MODULES = frozenset({"_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testclinic",
                          "_testimportmultiple", "_ctypes_test", "_xxsubinterpreters", "_xxinterpchannels",
                          "_xxtestfuzz", "_testsinglephase"})
WATCHED_IMPORTS = frozenset({"ctypes", "_ctypes", "gc", "inspect", "subprocess", "socket", "pty", "signal",
                             "multiprocessing", "_posixsubprocess", "mmap", "resource", "fcntl"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def frozen_codes() -> frozenset:
    """The interpreter's own frozen code (importlib, os, codecs, ...): every function's code object, as the
    interpreter unmarshals it, compared by value. A `<frozen ...>` file name proves nothing (any `compile`
    may choose it): code under such a name is the library's only when it equals one of these. Each frozen
    module is imported first (so none runs its module code later); module bodies are left out (run once,
    before learner code: code equal to one, run again, is the learner's)."""
    import _imp
    import importlib
    names = [n for n in getattr(_imp, "_frozen_module_names", lambda: [])() if not n.startswith("__")]
    out: set = set()
    for name in names:
        try:
            importlib.import_module(name)
            todo = [c for c in _imp.get_frozen_object(name).co_consts if type(c) is type(frozen_codes.__code__)]
        except (ImportError, AttributeError, ValueError):
            continue
        while todo:
            code = todo.pop()
            out.add(code)
            todo.extend(c for c in code.co_consts if type(c) is type(code))
    return frozenset(out)


# torch's C functions that install a callback the interpreter hands frames to (see the module docstring)
FRAME_CALLBACKS = ("set_eval_frame", "set_bytecode_debugger_callback")


def _frame_setter(name: str) -> Any:
    """torch's `torch._C._dynamo.eval_frame.<name>` under grading: None (or False) goes through, as
    `torch._dynamo.disable` uses it; a callback is refused. The real function is held by the hook only."""
    def setter(callback: Any) -> Any:
        box: list = []
        sys.audit("distlab.frames", name, callback, box)
        from distlab.grading.pgmeter import unbox
        return unbox(box, name)
    setter.__name__ = setter.__qualname__ = name
    setter.__doc__ = _frame_setter.__doc__.replace("<name>", name)
    return setter


FRAME_SETTERS = {name: _frame_setter(name) for name in FRAME_CALLBACKS}
set_eval_frame = FRAME_SETTERS["set_eval_frame"]


def _take_frame_callbacks() -> dict[str, Any]:
    """Replace torch's frame-callback setters by the functions above in every module that holds them
    (before learner code: nothing booked); the real ones, by name, for the hook alone."""
    import gc

    import torch
    module = torch._C._dynamo.eval_frame
    originals = {name: getattr(module, name) for name in FRAME_CALLBACKS if hasattr(module, name)}
    mine = FRAME_SETTERS
    for name, fn in originals.items():
        for holder in gc.get_referrers(fn):
            if type(holder) is dict and holder is not originals:   # module namespaces (torch._dynamo's
                                                                      # `from ... import set_eval_frame`)
                for k in [k for k, v in holder.items() if v is fn]:
                    holder[k] = mine[name]
    return originals


def install(stream_path: str, trusted_codes: dict[str, Any], snapshot_modules: tuple[str, ...],
            broker: Any = None) -> None:
    """Open the event stream, add the hook. Call once per rank, before learner code.

    `trusted_codes` maps each `distlab.*` event ('distlab.pg.op', 'distlab.pg.create',
    'distlab.region', 'distlab.lookup', 'distlab.checkpoint', 'distlab.finish') to the code
    object(s) allowed to raise it; `snapshot_modules` are the modules whose functions and
    classes a checkpoint compares; `broker`: the rank's `distlab.grading.broker.Client`, when a broker owns the
    real groups (the hook then holds none: it forwards each call there).

    The hook's parts are built by the functions below (`_sender`, `_stack_reader`, `_op_runner`, ...), each
    called once here: everything they use is bound in their closures now, none is looked up at run time.
    """
    from distlab.grading.pgmeter import Failed

    frame_setters = _take_frame_callbacks()
    libs, stdlib = library_roots()
    frozen = frozen_codes()
    tmp = os.path.realpath(__import__("tempfile").gettempdir()) + os.sep
    # the checkout (package, labs, solutions, a venv) may itself live under the temporary folder (a CI clone in
    # /tmp): it is never the rank's own
    outside = (os.path.dirname(os.path.dirname(os.path.realpath(os.path.dirname(__file__)))) + os.sep, *libs)
    send, safe = _sender(os.open(stream_path, os.O_WRONLY))
    busy, learner_cache, groups, live = [False], {}, {}, {}
    look = _stack_reader(libs, stdlib, frozen, learner_cache, busy)
    on_op = _op_runner(send, groups, live, broker)
    on_distlab = _distlab_events(trusted_codes, send, safe, on_op, frame_setters, groups, live,
                                 _snapshots(snapshot_modules, send), broker)
    watch = _watcher(send, safe, look, _tmp_test(tmp, outside), libs, on_distlab, busy)
    hook = _hook(watch, send, safe, Failed)
    # The frames below this call (the forkserver's `python -c` "<string>", the launcher's worker)
    # ran before any learner code: whatever their file name, they are not the learner's.
    f = sys._getframe(1)
    while f is not None:
        learner_cache[f.f_code] = False
        f = f.f_back
    sys.addaudithook(hook)


def _sender(fd: int) -> tuple[Any, Any]:
    """(send, safe): `send(*fields)` writes one record, a line of tab-separated fields, to `fd`; `safe(x)` is a
    short text for an event argument, without calling any of the learner's methods."""
    _type, _str, _int, _list, _tuple, _len = type, str, int, list, tuple, len
    _bool, _float, _bytes, join, replace, write = bool, float, bytes, str.join, str.replace, os.write
    name_of = type.__dict__["__name__"].__get__

    def send(*fields: Any) -> None:
        # tabs and newlines never reach a field (a learner-chosen file name could hold them), and a record is
        # one write below PIPE_BUF: a FIFO never interleaves it with another writer's bytes
        text = join("\t", [replace(replace(f if _type(f) is _str else safe(f), "\t", " "), "\n", " ")
                           for f in fields])
        try:
            write(fd, text.encode("utf-8", "replace")[:4000] + b"\n")
        except OSError:
            pass   # the runner sees the stream end early: that is the evidence

    def safe(x: Any, depth: int = 0) -> str:
        """A short text for an event argument, without calling any of the learner's methods."""
        t = _type(x)
        if t is _str:
            return x[:200].replace("\t", " ").replace("\n", " ")
        if t is _bytes:
            return safe(x[:200].decode("utf-8", "replace"))
        if t in (_int, _bool, _float) or x is None:
            return _str(x) if t is not _float else "%g" % x
        if t in (_tuple, _list) and depth < 2:
            return "(" + join(", ", [safe(v, depth + 1) for v in x[:4]]) + ")"
        return "<" + name_of(t) + ">"

    return send, safe


def _tmp_test(tmp: str, outside: tuple[str, ...]) -> Any:
    """`in_tmp(paths)`: every path is a plain one inside the rank's temporary folder `tmp` (the sandbox's private
    /tmp, or without a sandbox the submission's own folder), outside the runner's folder there (every rank's
    event stream and inputs) and outside `outside` (the checkout and the libraries): files there are the rank's
    own. Links stay evidence."""
    runner = tmp + "distlab-runner-"
    _len, _all, _type, _str, startswith = len, all, type, str, str.startswith

    def in_tmp(paths: tuple) -> bool:
        return _len(paths) > 0 and _all([_type(p) is _str and startswith(p, tmp) and "/.." not in p
                                         and not startswith(p, runner) and not startswith(p, outside)
                                         for p in paths])
    return in_tmp


def _stack_reader(libs: tuple[str, ...], stdlib: tuple[str, ...], frozen: frozenset, learner_cache: dict,
                  busy: list) -> Any:
    """`look()`: (code that raised the event, whether it is the learner's, where learner code is on the stack,
    where learner code caused it). Code is the learner's when it is not a library file's and not the
    interpreter's frozen code (a `<frozen ...>` name the learner chose proves nothing: such code is the
    library's only when it equals the interpreter's own)."""
    site_dirs = tuple(r for r in libs if r != stdlib[0])
    getframe, startswith, _str = sys._getframe, str.startswith, str

    def learner(code: Any) -> bool:
        hit = learner_cache.get(code)
        if hit is None:
            name = code.co_filename
            hit = code not in frozen if startswith(name, "<frozen ") else not startswith(name, libs)
            learner_cache[code] = hit
        return hit

    def in_stdlib(code: Any) -> bool:
        name = code.co_filename
        if startswith(name, "<frozen "):
            return code in frozen
        return startswith(name, stdlib) and not startswith(name, site_dirs)

    def first_learner(f: Any) -> Any:
        while f is not None:
            if learner(f.f_code):
                return f
            f = f.f_back
        return None

    def initiator(f: Any) -> Any:
        """The first frame above the event that is not the standard library: learner's or None."""
        while f is not None and in_stdlib(f.f_code):
            f = f.f_back
        return f if f is not None and learner(f.f_code) else None

    def where(f: Any) -> str:
        return f.f_code.co_filename + " line " + _str(f.f_lineno)

    def look() -> tuple[Any, bool, str, str]:
        """Reading frames raises audit events itself: `busy` makes the hook ignore those, and nothing here can
        run learner code."""
        busy[0] = True
        try:
            f = getframe(3)    # look <- watch <- hook <- the code that raised the event
            if f is None:
                return None, False, "", ""
            anywhere, cause = first_learner(f), initiator(f)
            return f.f_code, learner(f.f_code), where(anywhere) if anywhere else "", where(cause) if cause else ""
        finally:
            busy[0] = False

    return look


def _live_adder() -> Any:
    """`add_live(meter, kind, nbytes, ranks)`: what `track_comm`'s dispatch mode would count (it sees nothing
    under a Python process group): the meter's own dicts, updated with the builtin dict methods bound here; a
    meter that books by group (chapter 7's `track_comm_by_group`) gets the op under its group's ranks too."""
    from collections import defaultdict
    counters, obj_get, dict_get, dict_set = (dict, defaultdict), object.__getattribute__, dict.get, dict.__setitem__
    _type, _dict = type, dict

    def add_live(meter: Any, kind: str, nbytes: int, ranks: tuple = ()) -> None:
        state = obj_get(meter, "__dict__")
        if _type(state) is not _dict:
            return
        for field, amount in (("calls", 1), ("bytes", nbytes)):
            d = dict_get(state, field)
            if _type(d) in counters:
                dict_set(d, kind, (dict_get(d, kind) or 0) + amount)
        for field, amount in (("calls_by_group", 1), ("by_group", nbytes)):
            d = dict_get(state, field)
            if _type(d) is _dict:
                g = dict_get(d, ranks)
                if _type(g) is not _dict:
                    g = {}
                    dict_set(d, ranks, g)
                dict_set(g, kind, (dict_get(g, kind) or 0) + amount)
    return add_live


def _op_runner(send: Any, groups: dict, live: dict, broker: Any = None) -> Any:
    """`on_op(args)`: a call on a MeteredGroup, run on the real group (`groups`), booked, its Work handed back in
    the box; each op is also added to the `track_comm` meters open now (`live`)."""
    import torch
    from distlab.grading.pgmeter import COALESCING, OP_KINDS, algorithmic_bytes_booker
    base = torch._C.TensorBase
    book = algorithmic_bytes_booker(base.numel, base.element_size, base.dim, base.size)
    TensorBase, no_torch_fn, no_dispatch = torch._C.TensorBase, torch._C.DisableTorchFunction, \
        torch._C._DisableTorchDispatch
    mro_of, name_of = type.__dict__["__mro__"].__get__, type.__dict__["__name__"].__get__
    c10d_types = frozenset(v for v in vars(torch._C._distributed_c10d).values() if isinstance(v, type))
    PG, Device, kinds, markers = torch._C._distributed_c10d.ProcessGroup, torch.device, dict(OP_KINDS), \
        frozenset(COALESCING)
    from distlab.grading.broker import ALIASES
    aliases, add_live = dict(ALIASES), _live_adder()
    c10d_module = torch._C._distributed_c10d
    _type, _int, _bool, _float, _str, _list, _tuple, _len, _id, _getattr = \
        type, int, bool, float, str, list, tuple, len, id, getattr

    def clean(x: Any, depth: int = 0) -> Any:
        """The learner's call arguments, refusing anything whose conversion could run their code."""
        t = _type(x)
        if t in (_int, _bool, _float, _str) or x is None or t in c10d_types:
            return x
        if t in (_list, _tuple) and depth < 3:
            return t([clean(v, depth + 1) for v in x])
        if TensorBase in mro_of(t):
            return x
        raise TypeError("distlab grade: a process-group call got a " + name_of(t))

    def on_op(args: tuple) -> None:
        group, name, box, call = args
        entry = groups.get(_id(group))
        if entry is None or entry[0] is not group or _type(name) is not _str \
                or (name not in kinds and name not in markers) \
                or _type(box) is not _list or _type(call) is not _tuple:
            raise RuntimeError("distlab grade: a call on a process group the grader did not create")
        if name in markers:    # NCCL's group start/end around a batch_isend_irecv: no bytes
            if _len(call) != 1 or _type(call[0]) is not Device:
                raise TypeError("distlab grade: " + name + " takes one torch.device")
            marker = _getattr(entry[1], name)    # a Backend's binding takes no device, a ProcessGroup's does
            with no_dispatch():
                box.append(marker(call[0]) if PG in mro_of(_type(entry[1])) else marker())
            return
        call = clean(call)
        with no_torch_fn(), no_dispatch():    # a tensor subclass's Python methods never run here
            kind, nbytes = book(name, call, entry[2], entry[3])
            if broker is not None:     # the broker runs it and books it; the rank only keeps its meters' counts
                work = broker.issue(entry[4], name, call, TensorBase, c10d_module)
                for meter in _list(live.values()):
                    add_live(meter, kind, nbytes, entry[5])
                box.append(work)
                return
        # as the C++ dispatcher would run it: Python dispatch modes (a memory tracker) do not see the
        # backend's own temporaries
        with no_dispatch():
            work = _getattr(entry[1], aliases.get(name, name))(*call)
        # booked once issued: a call the backend refused (bad shapes) moved nothing and counts nothing
        send("op", kind, nbytes, entry[4])
        for meter in _list(live.values()):
            add_live(meter, kind, nbytes, entry[5])
        box.append(work)
    return on_op


def _snapshots(snapshot_modules: tuple[str, ...], send: Any) -> tuple[Any, Any]:
    """(take_snapshot, compare): the functions, classes and modules `snapshot_modules` hold now; `compare(place)`
    sends a `changed` record for each one rebound since (a class's own attributes included)."""
    modules = {name: sys.modules[name] for name in snapshot_modules if name in sys.modules}
    _dict, _list, _type, _callable, _typetype, module_type = dict, list, type, callable, type, type(sys)
    snap: dict[str, dict] = {}

    def take_snapshot() -> None:
        for name, mod in modules.items():
            d = _dict(mod.__dict__)
            watched = {k: v for k, v in d.items() if _callable(v) or _type(v) is module_type}
            for v in _list(watched.values()):
                if _type(v) is _typetype and v.__module__ == name:
                    snap[name + "." + v.__qualname__ + ".__dict__"] = _dict(v.__dict__)
            snap[name] = watched

    def compare(place: str) -> None:
        for name, before in snap.items():
            if name.endswith(".__dict__"):
                continue
            now = modules[name].__dict__
            for k, v in before.items():
                if now.get(k, None) is not v:
                    send("changed", name + "." + k, place)
                if _type(v) is _typetype and v.__module__ == name:
                    cls_before = snap.get(name + "." + v.__qualname__ + ".__dict__", {})
                    for ck, cv in cls_before.items():
                        if v.__dict__.get(ck, None) is not cv:
                            send("changed", name + "." + v.__qualname__ + "." + ck, place)
    return take_snapshot, compare


def _group_creator(send: Any, groups: dict, broker: Any = None) -> Any:
    """`on_create(args)`: the real process group behind a MeteredGroup: the broker's (gloo under grading), else
    built by the hook (NCCL, which opens sockets as it goes; gloo only before a seccomp filter, as in tests),
    kept in `groups` and booked (`pg`)."""
    import torch.distributed as dist
    Gloo, Nccl = dist.ProcessGroupGloo, getattr(dist, "ProcessGroupNCCL", None)
    _len, _tuple, _int, _str, _id = len, tuple, int, str, id

    def on_create(args: tuple) -> None:
        group, store, rank, size, timeout, members, name, box = args
        if broker is not None:     # the real group is the broker's (named as torch names it on every rank)
            gid = _str(name)
            broker.create(gid, rank, size, timeout.total_seconds())
            ranks = _tuple(_int(r) for r in members) if _len(members) == size else _tuple(range(size))
            groups[_id(group)] = (group, None, size, rank, gid, ranks)
            box.append(None)
            return
        if group._backend_name.endswith("nccl") and Nccl:
            options = Nccl.Options()
            options._timeout = timeout     # the stall window (rankside): NCCL's watchdog reports a hang
            inner = Nccl(store, rank, size, options)
        else:
            inner = Gloo(store, rank, size, timeout)
        gid = _len(groups)
        ranks = _tuple(_int(r) for r in members) if _len(members) == size else _tuple(range(size))
        groups[_id(group)] = (group, inner, size, rank, _str(gid), ranks)
        send("pg", _str(gid), size, rank)
        box.append(None)
    return on_create


def _region_book(send: Any, live: dict, broker: Any = None) -> tuple[Any, Any]:
    """(on_region, on_lookup): `track_comm` blocks as they open, close and report (`learner` = 1 when learner code
    was on the stack), and the region each reported `CommStats` belongs to (-1: none the hook saw; -2: one
    learner code opened or read)."""
    from distlab.meters.comm import _CommMeter
    mro_of, _type, _int, _id = type.__dict__["__mro__"].__get__, type, int, id
    meters: dict[int, tuple] = {}
    stats: dict[int, tuple] = {}
    region_count = [0]

    def on_region(args: tuple, src: str) -> None:
        edge, meter = args[0], args[1]
        mine = src != ""
        if edge == "begin":
            k = region_count[0]
            region_count[0] = k + 1
            meters[_id(meter)] = (meter, k, mine)
            # track_comm's meter, or a subclass of it (chapter 7's per-group meter): the hook only adds
            # counts to its plain dicts (exact dict types checked in add_live)
            if _CommMeter in mro_of(_type(meter)):
                live[_id(meter)] = meter
            send("region", "begin", k, _int(mine))
            if broker is not None:
                broker.region("begin", k)
        elif _id(meter) in meters:
            _, k, was = meters[_id(meter)]
            if edge == "end":
                live.pop(_id(meter), None)
                send("region", "end", k, _int(was or mine))
                if broker is not None:
                    broker.region("end", k)
            elif edge == "stats":
                stats[_id(args[2])] = (args[2], k, was or mine)

    def on_lookup(args: tuple) -> None:
        objs, out = args
        if broker is not None:    # every op and region marker sent so far is booked before the outputs leave
            broker.sync()
        for obj in objs:
            hit = stats.get(_id(obj))
            out.append(-1 if hit is None or hit[0] is not obj else (-2 if hit[2] else hit[1]))
    return on_region, on_lookup


def _distlab_events(trusted_codes: dict[str, Any], send: Any, safe: Any, on_op: Any, frame_setters: dict[str, Any],
                    groups: dict, live: dict, snapshots: tuple[Any, Any], broker: Any = None) -> Any:
    """`on_distlab(ev, args, code, src)`: a `distlab.*` event, run when raised by the code allowed to raise it
    (`trusted_codes`), else booked as forged; `src`: where learner code is on the stack ('' when nowhere)."""
    codes = {role: frozenset(c if isinstance(c, (list, tuple)) else (c,)) for role, c in trusted_codes.items()}
    codes["distlab.frames"] = frozenset((set_eval_frame.__code__,))     # every setter's (one code object)
    on_create = _group_creator(send, groups, broker)
    on_region, on_lookup = _region_book(send, live, broker)
    take_snapshot, compare = snapshots

    def on_distlab(ev: str, args: tuple, code: Any, src: str) -> None:
        if code is None or code not in codes.get(ev, ()) or (src and ev in (
                "distlab.lookup", "distlab.checkpoint", "distlab.finish")):
            send("ev", "forged " + ev, "a distlab audit event not raised by distlab", src)
            return      # nothing runs: a forged op's caller finds its box empty
        if ev == "distlab.pg.op":
            on_op(args)
        elif ev == "distlab.pg.create":
            on_create(args)
        elif ev == "distlab.frames":
            name, callback, box = args
            if callback is None or callback is False:
                box.append(frame_setters[name](callback))
                return
            if src:
                send("ev", name, "a frame-evaluation callback (torch.compile, a debugger) would see the grader's "
                               "frames", src)
            raise RuntimeError("distlab grade: " + name + " with a callback is not available under grading "
                               "(torch.compile and frame hooks are switched off)")
        elif ev == "distlab.region":
            on_region(args, src)
        elif ev == "distlab.lookup":
            on_lookup(args)
        elif ev == "distlab.checkpoint":
            if args[0] == "snapshot":
                take_snapshot()
            else:
                compare(args[0])
        elif ev == "distlab.shortcut":
            if src:     # constructed with learner code on the stack (the check's own use is not the learner's)
                send("ev", "used " + safe(args[0]), "this lab asks you to write it yourself", src)
        elif ev == "distlab.finish":
            send("end")
    return on_distlab


def _hook(watch: Any, send: Any, safe: Any, Failed: type) -> Any:
    """The hook: `watch`, never raising: an exception leaving the hook would carry its frames (and through them
    its closure) to whoever catches it. A distlab call that fails gets a `Failed` in its box instead."""
    import torch.distributed as dist
    # exceptions a failing call may come back as (anything else: RuntimeError); their text is read with
    # BaseException.__str__, so no subclass's code runs here
    raisable = frozenset((TypeError, ValueError, RuntimeError, IndexError, NotImplementedError, OverflowError,
                          *(getattr(dist, n) for n in ("DistError", "DistBackendError", "DistNetworkError",
                                                       "DistStoreError") if hasattr(dist, n))))
    exc_str, name_of = BaseException.__str__, type.__dict__["__name__"].__get__
    boxed_at = {"distlab.pg.op": 2, "distlab.pg.create": 7, "distlab.frames": 2}
    _type, _str, _tuple, _list, _len = type, str, tuple, list, len

    def hook(ev: Any, args: Any) -> None:
        try:
            watch(ev, args)
        except BaseException as exc:  # noqa: BLE001 - see the docstring
            at = boxed_at.get(ev) if _type(ev) is _str else None
            box = args[at] if at is not None and _type(args) is _tuple and _len(args) > at else None
            t = _type(exc)
            try:
                if _type(box) is _list and not box:
                    box.append(Failed(t if t in raisable else RuntimeError,
                                      exc_str(exc) if t in raisable else name_of(t) + ": " + exc_str(exc)))
                else:    # fail closed: an event the hook could not read is evidence
                    send("ev", "unreadable event", "the audit hook could not read " + safe(ev) + " ("
                         + name_of(t) + ")", "")
            except BaseException:  # noqa: BLE001 - nothing may leave the hook
                pass
    return hook


def _watcher(send: Any, safe: Any, look: Any, in_tmp: Any, libs: tuple[str, ...], on_distlab: Any,
             busy: list) -> Any:
    """`watch(ev, args)`: which events become records (see the module docstring); the event lists are bound
    here, so rebinding the module's names later changes nothing."""
    watched, prefixes, tmp_events, anywhere_events, anywhere_prefixes = \
        WATCH, PREFIXES, TMP_EVENTS, ANYWHERE, ANYWHERE_PREFIXES
    frame_attrs, test_modules, watched_imports, write_flags = FRAME_ATTRS, TEST_MODULES, WATCHED_IMPORTS, _WRITE_FLAGS
    _type, _str, _int, _tuple, _len, _any, _getattr, startswith = type, str, int, tuple, len, any, getattr, \
        str.startswith

    def watch(ev: Any, args: Any) -> None:
        if busy[0]:
            return
        if _type(ev) is not _str or _type(args) is not _tuple:
            send("ev", "odd audit event", "an event whose name is not a plain str", "")
            return
        distlab_event = startswith(ev, "distlab.")
        if not distlab_event and ev not in watched and not startswith(ev, prefixes):
            return
        code, direct, anywhere, cause = look()
        if distlab_event:
            on_distlab(ev, args, code, anywhere)
            return
        if ev == "open":
            if not anywhere:
                return
            path, mode, flags = (args + (None, None, 0))[:3]
            writes = (_type(mode) is _str and _any([c in mode for c in "wax+"])) or (
                _type(flags) is _int and flags & write_flags)
            if _type(path) is _str and not writes and startswith(path, libs) and "/.." not in path:
                return
            if in_tmp((path,)):
                return
            send("ev", "open", safe(path) + (" for writing" if writes else ""), anywhere)
            return
        if anywhere and ev == "import" and args and _type(args[0]) is _str and args[0].split(".")[0] in test_modules:
            send("ev", "import", args[0], cause or anywhere)
            return
        if anywhere and (ev in anywhere_events or startswith(ev, anywhere_prefixes)):
            detail = safe(args[1]) if startswith(ev, "object.") and _len(args) > 1 else safe(args[:2])
            send("ev", ev, detail, cause or anywhere)
            return
        if not cause:
            return
        if ev in tmp_events and in_tmp(args[:2] if ev == "os.rename" else args[:1]):
            return    # the rank's own temporary folder (a checkpoint written and read back, lab 09)
        if ev in ("os.listdir", "os.scandir") and args and _type(args[0]) is _str and startswith(
                args[0], libs) and "/.." not in args[0]:
            return    # the import system lists library folders
        if ev == "import" and not (args and _type(args[0]) is _str and args[0].split(".")[0] in watched_imports):
            return
        if ev == "object.__getattr__" and not (_len(args) > 1 and args[1] in frame_attrs):
            return
        if ev in ("compile", "exec"):   # imports compile and run library files: only direct calls count
            name = args[1] if ev == "compile" and _len(args) > 1 else _getattr(args[0], "co_filename", "")
            if not (direct and _type(name) is _str and (startswith(name, libs) or startswith(name, "<frozen "))):
                return
            send("ev", ev, "code under a library file name: " + safe(name), cause)
            return
        if startswith(ev, "marshal."):  # code objects from bytes: only the import system's own calls are fine
            if direct:
                send("ev", ev, "code objects from bytes", cause)
            return
        detail = safe(args[1]) if startswith(ev, "object.") and _len(args) > 1 else safe(args[:2])
        send("ev", ev, detail, cause)
    return watch
