"""Issues 28 and 38: a graded rank holds nothing a learner could use to fake its traffic, and what it can reach is
booked or refused.

The hook is installed in a fresh interpreter (an audit hook cannot be removed: never in pytest's own
process) on top of a real broker (`distlab.grading.broker`, forked from the script's own fork server as the
runner does), by a script that then plays the learner, from a file outside the library:

- it walks every object gc tracks, what they refer to, every thread's frames and the audit hook's own
  closures (reached through gc: nothing hides them), and finds no real process group and no key: the broker
  holds the groups, and the hook holds no secret;
- it asks torch for a frame-evaluation callback: refused, and booked;
- a call the hook fails (an argument it refuses, a gloo error in the broker, a forged event) leaves no
  traceback through the hook's frames;
- it writes traffic records straight into its own event stream (no audit event on the way): the grader's
  `read_stream` refuses the stream, and the traffic stays the broker's.

The script prints one JSON line; the stream it wrote and the broker's books are read with the grader's own
`read_stream`. About 5 s (one broker, one gc walk).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from distlab.grading.evidence import read_stream

LEARNER = textwrap.dedent('''
    import gc, json, os, sys, types
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch._dynamo       # imported before the hook: its module holds the real set_eval_frame
    from torch._dynamo.types import ConvertFrameReturn

    from distlab.grading import audithook, broker, pgmeter
    from distlab.grading.runner import _fork_server

    _fork_server(())           # the broker comes from a fork of this process, as in the runner
    folder = os.path.dirname(sys.argv[1])
    brokers = broker.Brokers(folder, 1)
    audithook.install(sys.argv[1], {"distlab.pg.op": pgmeter.MeteredGroup._op.__code__,
                                    "distlab.pg.create": pgmeter.create.__code__}, snapshot_modules=(),
                      broker=broker.Client(*brokers.paths[0]))
    group = pgmeter.create(SimpleNamespace(store=dist.HashStore(), group_rank=0, group_size=1,
                                           timeout=timedelta(seconds=30), global_ranks_in_group=[0], group_id="0"),
                           backend_name="metered_gloo")
    REAL = ("ProcessGroupGloo", "ProcessGroupNCCL")

    def learner():     # its own code object: the module's frame ran before the hook, so it is not the learner's
        out = {}
        work = group.allreduce([torch.ones(2)])     # through the broker, as every graded op
        work.wait()

        # 1. every object gc tracks and what it refers to (pybind objects are not tracked themselves), every
        # thread's frames, and the hook's closures: no real process group, no bytes (a key) anywhere in them
        objs = gc.get_objects()
        everything = objs + gc.get_referents(*objs)
        for frame in sys._current_frames().values():
            while frame is not None:
                everything += list(frame.f_locals.values())
                frame = frame.f_back
        hook_fns = [o for o in objs if type(o) is types.FunctionType
                    and o.__code__.co_filename == audithook.__file__ and o.__closure__]
        cells = [c.cell_contents for f in hook_fns for c in f.__closure__ if c.cell_contents is not None]
        everything += cells + gc.get_referents(*cells)
        out["objects_walked"] = len(everything)
        out["hook_functions_reached"] = sorted({f.__name__ for f in hook_fns} & {"hook", "watch", "send", "on_op"})
        out["groups"] = sorted({type(x).__name__ for x in everything if type(x).__name__ in REAL})
        out["bytes_in_hook"] = sorted({type(x).__name__ for x in cells if type(x) in (bytes, bytearray)})

        # 2. torch's frame-evaluation callback, through every name torch keeps it under
        frames = []
        def callback(frame, *rest):
            frames.append(frame.f_code.co_name)
            return ConvertFrameReturn(apply_to_code=False)
        refused = []
        for setter in (torch._C._dynamo.eval_frame.set_eval_frame, torch._dynamo.eval_frame.set_eval_frame):
            try:
                setter(callback)
                sys.audit("anything")
            except RuntimeError as exc:
                refused.append(str(exc)[:120])
            finally:
                torch._C._dynamo.eval_frame.set_eval_frame(None)
        out["refused"], out["frames_seen"] = refused, frames

        @torch._dynamo.disable            # torch's own use (set_eval_frame(None)) still works
        def plain(x):
            return x + 1
        out["disabled_call"] = plain(torch.ones(1)).item()

        # 3. failures leave no traceback through the hook
        failures = []
        for call in (lambda: group.allreduce([object()]),                    # an argument the hook refuses
                     lambda: group.allreduce([torch.ones(2), torch.ones(3)])):  # a gloo error, in the broker
            try:
                call()
                failures.append("no error")
            except Exception as exc:
                tb, names = exc.__traceback__, []
                while tb is not None:
                    names.append(tb.tb_frame.f_code.co_filename == audithook.__file__)
                    tb = tb.tb_next
                failures.append([type(exc).__name__, any(names), exc.__context__ is None])
        out["failures"] = failures
        box = []
        sys.audit("distlab.pg.op", group, "allreduce", box, ([torch.ones(2)],))    # forged: nothing runs
        out["forged_ran"] = bool(box)
        import importlib
        importlib.import_module("_testinternalcapi")    # CPython's internals, with no audit events of their own

        # 4. traffic written straight into the event stream (found by its inode: os.fstat raises no event)
        ino = os.stat(sys.argv[1]).st_ino
        for fd in range(3, 256):
            try:
                if os.fstat(fd).st_ino == ino:
                    os.write(fd, b"op\\tall_reduce\\t1048576\\t0\\nregion\\tbegin\\t0\\t0\\nend\\n")
            except OSError:
                pass
        print("RESULT " + json.dumps(out), flush=True)


    learner()
    brokers.stop()
    with open(sys.argv[2], "wb") as f:       # what the broker booked (the runner's pipe)
        f.write(os.read(brokers.fds()[0], 1 << 20))
''')


def test_a_rank_holds_no_group_and_no_key_and_its_routes_are_booked_or_refused(tmp_path):
    script, stream, booked = tmp_path / "learner.py", tmp_path / "stream", tmp_path / "booked"
    script.write_text(LEARNER)
    stream.touch()
    done = subprocess.run([sys.executable, str(script), str(stream), str(booked)], capture_output=True, text=True,
                          timeout=300)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    # a real walk, which reached the hook's own functions, and found no real group and no key in them
    assert out["objects_walked"] > 100_000, out
    assert out["hook_functions_reached"] == ["hook", "on_op", "send", "watch"], out
    assert out["groups"] == [] and out["bytes_in_hook"] == [], out
    # both names of torch's callback setter refuse a callback; the callback never saw a frame
    assert len(out["refused"]) == 2 and all("not available under grading" in r for r in out["refused"]), out
    assert out["frames_seen"] == [] and out["disabled_call"] == 2.0, out
    # failures come back as fresh exceptions raised outside the hook
    assert out["failures"] == [["TypeError", False, True], ["RuntimeError", False, True]], out
    assert out["forged_ran"] is False, out
    log = read_stream(stream.read_bytes(), broker=booked.read_bytes())
    assert log.op_calls == {"all_reduce": 1}, log.op_calls     # the broker's booking, not the written records
    assert "did not write" in log.problem, log.problem         # the written records refuse the stream
    text = "\n".join(log.evidence)
    assert "set_eval_frame" in text and "forged distlab.pg.op" in text, text
    assert "gc.get_objects" in text and "_testinternalcapi" in text, text      # booked before it returned anything
