"""Issue 28: the evidence's sender (the audit hook, its key, its state) is out of the learner's reach.

The hook is installed in a fresh interpreter (an audit hook cannot be removed: never in pytest's own
process) by a script that then plays the learner, from a file outside the library:

- it follows every reference from what it can name (every module, the builtins, every class) with
  `gc.get_referents`, and meets neither the hook's functions nor its key;
- it asks torch for a frame-evaluation callback, the route that handed the hook's frame (closure and key)
  to learner code with no audit event: refused, and booked;
- a call the hook fails (an argument it refuses, a forged event) leaves no traceback through the hook's
  frames.

The script prints one JSON line; the stream it wrote is read with the grader's own `read_stream`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from distlab.grading.evidence import read_stream

LEARNER = textwrap.dedent('''
    import gc, hashlib, json, sys, types
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch._dynamo       # imported before the hook: its module holds the real set_eval_frame
    from torch._dynamo.types import ConvertFrameReturn

    from distlab.grading import audithook, pgmeter

    # the functions `install` makes (the hook, its sender, its helpers: made by the module's builders, each
    # called once by install), not the module's own builders
    builders = [f for f in vars(audithook).values() if isinstance(f, types.FunctionType)
                and f.__module__ == audithook.__name__ and f.__code__.co_filename == audithook.__file__]
    hook_codes = audithook._codes_of(*builders) - {f.__code__ for f in builders}
    assert {"hook", "watch", "send", "look", "on_op", "on_distlab", "in_tmp"} <= {c.co_name for c in hook_codes}
    audithook.install(sys.argv[1], {"distlab.pg.op": pgmeter.MeteredGroup._op.__code__,
                                    "distlab.pg.create": pgmeter.create.__code__}, snapshot_modules=())
    def learner():     # its own code object: the module's frame ran before the hook, so it is not the learner's
        out = {}
        with open(sys.argv[1], "rb") as f:        # the key: the stream's first 32 bytes (the runner's view)
            key = f.read(32)
        key_digest = hashlib.sha256(key).digest()
        del key

        # 1. every object reachable by reference from what a learner can name
        def subclasses(root):
            seen, todo = [], [root]
            while todo:
                cls = todo.pop()
                seen.append(cls)
                try:
                    todo.extend(type.__subclasses__(cls))
                except TypeError:
                    pass
            return seen
        roots = [sys.modules, vars(__builtins__) if isinstance(__builtins__, types.ModuleType) else __builtins__,
                 *subclasses(object)]
        seen, level, hooks, keys = set(), roots, [], 0
        while level:
            fresh = [o for o in level if id(o) not in seen]
            seen.update(id(o) for o in fresh)
            for o in fresh:
                if type(o) is types.FunctionType and o.__code__ in hook_codes:
                    hooks.append(o.__code__.co_name)
                elif type(o) is bytes and len(o) == 32 and hashlib.sha256(o).digest() == key_digest:
                    keys += 1
            level = gc.get_referents(*fresh)
        out["objects_walked"], out["hook_functions_reached"], out["keys_reached"] = len(seen), sorted(set(hooks)), keys

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
        store = dist.HashStore()
        opts = SimpleNamespace(store=store, group_rank=0, group_size=1, timeout=timedelta(seconds=5),
                               global_ranks_in_group=[0])
        group = pgmeter.create(opts, backend_name="metered_gloo")
        work = group.allreduce([torch.ones(2)])
        work.wait()
        failures = []
        for call in (lambda: group.allreduce([object()]),                    # an argument the hook refuses
                     lambda: group.allreduce([torch.ones(2), torch.ones(3)])):  # a gloo error
            try:
                call()
                failures.append("no error")
            except Exception as exc:
                tb, names = exc.__traceback__, []
                while tb is not None:
                    names.append(tb.tb_frame.f_code in hook_codes)
                    tb = tb.tb_next
                failures.append([type(exc).__name__, any(names), exc.__context__ is None])
        out["failures"] = failures
        box = []
        sys.audit("distlab.pg.op", group, "allreduce", box, ([torch.ones(2)],))    # forged: nothing runs
        out["forged_ran"] = bool(box)
        import importlib
        importlib.import_module("_testinternalcapi")    # CPython's internals, with no audit events of their own
        print("RESULT " + json.dumps(out))


    learner()
''')


def test_the_hook_is_out_of_reach_and_its_routes_are_booked_or_refused(tmp_path):
    script, stream = tmp_path / "learner.py", tmp_path / "stream"
    script.write_text(LEARNER)
    stream.touch()
    done = subprocess.run([sys.executable, str(script), str(stream)], capture_output=True, text=True, timeout=300)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    # a real walk (torch's whole object graph), which never met the hook or its key
    assert out["objects_walked"] > 100_000, out
    assert out["hook_functions_reached"] == [] and out["keys_reached"] == 0, out
    # both names of torch's callback setter refuse a callback; the callback never saw a frame
    assert len(out["refused"]) == 2 and all("not available under grading" in r for r in out["refused"]), out
    assert out["frames_seen"] == [] and out["disabled_call"] == 2.0, out
    # failures come back as fresh exceptions raised outside the hook
    assert out["failures"] == [["TypeError", False, True], ["RuntimeError", False, True]], out
    assert out["forged_ran"] is False, out
    log = read_stream(stream.read_bytes())
    assert log.problem == "", log.problem
    assert log.op_calls == {"all_reduce": 1}, log.op_calls     # the real call, not the forged one
    text = "\n".join(log.evidence)
    assert "set_eval_frame" in text and "forged distlab.pg.op" in text, text
    assert "gc.get_referents" in text and "_testinternalcapi" in text, text        # the walk itself is booked, before it returned anything
