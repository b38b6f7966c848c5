"""`distlab grade`, the parts that need no ranks: the runner's records, safe unpickling, booking, evidence, lab and
submission reading, the sandbox's command line, reports, and the audit hook (in a child process: a hook
cannot be removed, so never in the test process)."""
from __future__ import annotations

import csv
import json
import os
import pickle
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest
import torch

from distlab.grading import evidence, resultcheck, sandbox, seccomp, submission, wire
from distlab.grading.grade import Result, Verdict, summarize
from distlab.grading.lab import grade_calls, load_lab
from distlab.grading.pgmeter import OP_KINDS, algorithmic_bytes_booker
from distlab.grading.rankside import REGION_KEY
from distlab.grading.safeload import MAX_OPS as UNSAFE_OPS, UnsafeResult, plain_loads
from distlab.meters.comm import CommStats

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the runner's records and safe unpickling

def test_the_runner_reads_the_ranks_secret_inputs_only_after_its_job():
    """Two messages on the runner's stdin: the job without inputs (read exactly, before the ranks' fork server
    is forked), then the inputs. A rank's memory never held another rank's (test_grading_class probes it)."""
    from distlab.grading.runner import read_message
    job = {"cap_s": 1, "parts": [{"lab": "a", "inputs": {"t/0": ["AAAA", "BBBB"]}}, {"lab": "b", "inputs": {}}]}
    r, w = os.pipe()
    os.write(w, sandbox.job_lines(job))
    os.close(w)
    bare = read_message(r)
    assert "AAAA" not in json.dumps(bare) and [p["lab"] for p in bare["parts"]] == ["a", "b"]
    assert read_message(r) == [{"t/0": ["AAAA", "BBBB"]}, {}]
    os.close(r)


def test_the_runner_s_records_are_json_lines_and_a_malformed_or_cut_one_is_refused():
    good = b'{"kind": "case", "task": "t"}\n{"kind": "done"}\n'
    assert sandbox.records_of(good) == ([{"kind": "case", "task": "t"}, {"kind": "done"}], False)
    assert sandbox.records_of(good[:-3]) == ([{"kind": "case", "task": "t"}], False)   # cut: no done record
    assert sandbox.records_of(b"PASS all\n" + good)[1] is True
    assert sandbox.records_of(b"[1]\n")[1] is True


def test_plain_loads_takes_plain_data_and_refuses_everything_else_at_once():
    data = {"type": "ValueError", "message": "x" * 1000, "traceback": "", "n": [1, 2.5, None, True, b"raw"]}
    assert plain_loads(pickle.dumps(data, protocol=5)) == data
    assert plain_loads(pickle.dumps(b"\0" * (1 << 20), protocol=5)) == b"\0" * (1 << 20)

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    bomb = b"\x80\x04)\x94" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(60)) \
        + b"(h" + bytes([60]) + b"\x91."     # unpickled, hashing its frozenset would take 2^60 steps
    for bad, why in ((pickle.dumps(Evil()), "operation STACK_GLOBAL"), (pickle.dumps(print), "STACK_GLOBAL"),
                     (bomb, "operation EMPTY_TUPLE"), (pickle.dumps((1, 2)), "TUPLE2"),
                     (b"\x80\x04garbage", "unreadable"), (b"", "unreadable"), (b"N" * (UNSAFE_OPS + 1) + b".", "more than")):
        with pytest.raises(UnsafeResult, match=why):
            plain_loads(bad)


# ---------------------------------------------------------------- results: safetensors + JSON, checked in a child

def _outputs():
    from distlab.meters.memory import MemoryStats
    return {"results": {(7, "torch.bfloat16", "max"): torch.arange(7).to(torch.bfloat16)[2:]},
            "comm": {REGION_KEY: 3}, "dtype": torch.int64, "size": torch.Size([2]), "mem": MemoryStats(10, 20),
            "flags": [True, None, 1.5, float("nan")], "empty": torch.zeros(0, 3), "scalar": torch.tensor(4)}


def test_outputs_cross_as_safetensors_and_json_and_come_back_equal():
    blob = wire.encode(_outputs())
    assert blob[8:].startswith(b"{") and resultcheck.problem(blob) == ""
    back = wire.decode(blob)
    want = _outputs()
    assert torch.equal(back["results"][7, "torch.bfloat16", "max"], want["results"][7, "torch.bfloat16", "max"])
    assert back["results"][7, "torch.bfloat16", "max"].dtype == torch.bfloat16
    assert back["comm"] == {REGION_KEY: 3} and back["dtype"] is torch.int64 and back["size"] == torch.Size([2])
    assert back["mem"] == want["mem"] and back["flags"][:3] == [True, None, 1.5] and back["flags"][3] != 0.0
    assert back["empty"].shape == (0, 3) and back["scalar"].item() == 4
    with pytest.raises(TypeError, match="cannot carry"):
        wire.encode({"x": object()})


def _forged(header: dict, data: bytes = b"") -> bytes:
    import struct
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize("blob, why", [
    (b"\x01", "shorter than its header"),
    (b"\xff" * 8 + b"{}", "header length is out of bounds"),
    (_forged({"__metadata__": {"distlab": "[" * 100_000}}), "not JSON (RecursionError)"),
    (_forged({"__metadata__": {"distlab": json.dumps({"list": [0] * 300_000})}}), "too deep or too large"),
    (_forged({"__metadata__": {"distlab": '{"tensor": "t9"}'}}), "a tensor that is not there"),
    (_forged({"__metadata__": {"distlab": '{"call": "os.system"}'}}), "unknown tag"),
    (_forged({"__metadata__": {"distlab": '{"dtype": ["float32"]}'}}), "an unknown dtype"),
    (_forged({"t0": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": {"distlab": "1"}},
             b"\0" * 8), "its byte range does not match its shape"),
    (_forged({"t0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "t1": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"distlab": "1"}},
             b"\0" * 8), "overlap or leave gaps"),
    (_forged({"__metadata__": {"distlab": "1"}}, b"\0" * (33 << 20)), "33 MiB of outputs (limit 32 MiB)"),
])
def test_a_result_outside_its_bounds_is_refused_with_a_reason(blob, why):
    assert why in resultcheck.problem(blob)


def test_results_are_checked_in_a_child_with_a_deadline():
    good, bad = wire.encode(_outputs()), _forged({"__metadata__": {"distlab": '{"tensor": 1}'}})
    assert resultcheck.check_in_child([good, bad]) == ["", "a reference to a tensor that is not there"]
    assert resultcheck.check_in_child([good], deadline_s=0.001) == [
        "its outputs could not be checked within 0.001 s"]


def test_secret_inputs_differ_from_the_package_s_and_reach_one_rank_only(tmp_path):
    from distlab.checks import ch01
    from distlab.grading import secret
    task = ch01.TASKS["all_reduce"]
    case = task.cases()[1]                                 # 3 ranks
    inputs = secret.draw(task, case)
    assert len(inputs) == 3 and inputs[1]["7"].shape == (7,)
    assert not torch.equal(inputs[1]["7"].float(), ch01.data(1, 7, torch.float32))
    assert not torch.equal(secret.draw(task, case)[1]["1001"], inputs[1]["1001"])    # a fresh seed each time
    ref = task.reference(case, inputs=inputs)              # computed from the drawn inputs, not the package's
    want = sum(x["1001"] for x in inputs).to(torch.bfloat16)
    assert torch.equal(ref[1001, "torch.bfloat16", "sum"], want)
    fd = secret.offer(str(tmp_path / "inputs1"), secret.blob(inputs[1]))
    got = secret.load(secret.receive(str(tmp_path / "inputs1")))
    os.close(fd)
    assert not (tmp_path / "inputs1").exists()            # unlinked by its reader: no other rank can open it
    assert got.keys() == inputs[1].keys() and all(torch.equal(got[k], inputs[1][k]) for k in got)
    big = secret.blob({"w": torch.zeros(200_000)})        # 800 kB: past a FIFO's default 64 KiB
    fd = secret.offer(str(tmp_path / "big"), big)
    assert secret.receive(str(tmp_path / "big")) == big
    os.close(fd)
    assert secret.draw(ch01.TASKS["all_reduce"].__class__.__mro__[1](), case) is None    # Task's default: fixed


# What each lab draws under grading (issue 28): every task whose values are judged from inputs a rank could
# otherwise rebuild. Not drawn: ch04's buckets and memory, ch06's traffic and seconds (no inputs); ch07's training
# (every rank holds the whole model and the same batch, by design: its traffic line is what makes it communicate;
# ch07's layers and SP block draw their inputs and gradients, the layer stays whole); ch08's predict (judges the predictions and 1F1B's bytes
# and peak, no values), its schedule tables (no inputs) and offload_state (where the state lives).
DRAWN = {"01_collectives": {"reduce_scatter", "all_gather", "all_reduce", "naive_all_reduce"},
         "02_ddp": {"naive", "overlapped", "bucket_layout", "bucketed"},
         "03_zero1": {"init", "reduce_scatter_grad", "all_gather_params", "step", "loss_scaler"},
         "04_zero2": {"construct", "backward", "step"},
         "05_zero3": {"shard", "forward", "backward", "train", "prefetch", "bf16"}, "06_fsdp": {"wrap"},
         "07_tensor_parallel": {"f_g", "column", "row", "mlp", "attention", "sp_ops", "sp_block", "zigzag",
                                "ulysses"},
         "08_pipeline": {"forward", "gpipe", "1f1b", "step_3d", "offload_grads", "offload_step"}}


def test_labs_draw_their_inputs_one_dict_per_rank_each_within_a_fifo():
    from distlab.checks import lab_module
    from distlab.grading import secret
    for lab, want in DRAWN.items():
        got = set()
        for name, task in lab_module(lab).TASKS.items():
            case = max(task.cases(), key=lambda c: c.world_size)
            drawn = secret.draw(task, case)
            if drawn is None:
                continue
            got.add(name)
            assert len(drawn) == case.world_size and all(d and all(v.device.type == "cpu" for v in d.values())
                                                         for d in drawn), (lab, name)
            assert max(len(secret.blob(d)) for d in drawn) + 8 <= secret.MAX_BYTES, (lab, name)
        assert got == want, lab


# ---------------------------------------------------------------- the seccomp filter, in a child process

SECCOMP_SCRIPT = r"""
import ctypes, fcntl, os, signal, socket, subprocess, sys, threading
from distlab.grading import seccomp
kept = socket.socket()                      # opened before the filter: keeps working
r, w = os.pipe()
assert seccomp.confine()
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    if libc.syscall(*[ctypes.c_long(a) for a in args]) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
nr = seccomp.ARCHES[seccomp.platform.machine()][2]
def tried(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return exc.strerror
box = []
thread = threading.Thread(target=lambda: box.append(tried(lambda: socket.socket())))
thread.start(); thread.join()
print({"socket": tried(lambda: socket.socket()), "socketpair": tried(socket.socketpair),
       "fork": tried(os.fork), "subprocess": tried(lambda: subprocess.run(["true"])), "setsid": tried(os.setsid),
       "thread": "ok" if box else "no", "socket_in_thread": box[0], "kept": tried(kept.close),
       "kill_parent": tried(lambda: os.kill(os.getppid(), 0)), "kill_group": tried(lambda: os.kill(0, 0)),
       "kill_self": tried(lambda: os.kill(os.getpid(), 0)),
       "signal_own_thread": tried(lambda: signal.pthread_kill(threading.main_thread().ident, 0)),
       "io_uring": tried(lambda: call(nr["io_uring_setup"], 8, 0)),
       "sigio_owner": tried(lambda: fcntl.fcntl(r, fcntl.F_SETOWN, os.getppid())),
       "fcntl": tried(lambda: fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK))})
"""


@pytest.mark.skipif(not seccomp.available(), reason="seccomp filters need Linux on x86-64 or aarch64")
def test_the_seccomp_filter_stops_sockets_processes_signals_and_io_uring_but_not_threads():
    run = subprocess.run([sys.executable, "-c", SECCOMP_SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    no = "Operation not permitted"
    assert eval(run.stdout) == {"socket": no, "socketpair": no, "fork": no, "subprocess": no, "setsid": no,  # noqa: S307
                                "thread": "ok", "socket_in_thread": no, "kept": "ok",
                                # no signal reaches the runner or the grader (issue 38): only this process
                                "kill_parent": no, "kill_group": no, "kill_self": "ok", "signal_own_thread": "ok",
                                "io_uring": no, "sigio_owner": no, "fcntl": "ok"}


DUMPABLE_SCRIPT = r"""
import ctypes, os
from distlab.grading import seccomp
if os.getuid() == 0:          # an unprivileged uid, as graded ranks run (root may read any process's /proc)
    os.setgid(65534)
    os.setuid(65534)
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()              # stands for a rank's pipe to its broker
def sibling_opens_it():       # a process of the same uid opens the pipe through /proc/<pid>/fd, for writing
    me, (rr, ww) = os.getpid(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(os.open(f"/proc/{me}/fd/{w}", os.O_WRONLY))
            os.write(ww, b"opened")
        except OSError as exc:
            os.write(ww, exc.strerror.encode())
        os._exit(0)
    os.close(ww)
    os.waitpid(pid, 0)
    return os.read(rr, 200).decode()
libc.prctl(4, 1, 0, 0, 0)     # dumpable, as a process that never changed uid is
before = sibling_opens_it()
seccomp.no_dump()
after = sibling_opens_it()
assert seccomp.confine()
again = "ok" if libc.prctl(4, 1, 0, 0, 0) == 0 else os.strerror(ctypes.get_errno())
print({"before": before, "after": after, "set_dumpable_again": again, "dumpable": libc.prctl(3, 0, 0, 0, 0)})
"""


@pytest.mark.skipif(not seccomp.available(), reason="seccomp filters need Linux on x86-64 or aarch64")
def test_a_graded_rank_s_pipes_are_closed_to_its_siblings_through_proc():
    """Ranks run as one uid: a dumpable rank's pipe to its broker opens from a sibling through /proc/<pid>/fd.
    `no_dump` (a rank's first act) closes that, and the rank's seccomp filter keeps it closed."""
    run = subprocess.run([sys.executable, "-c", DUMPABLE_SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert eval(run.stdout) == {"before": "opened", "after": "Permission denied",  # noqa: S307
                                "set_dumpable_again": "Operation not permitted", "dumpable": 0}


# ---------------------------------------------------------------- what the metered group books

def test_the_booker_books_the_comm_meters_algorithmic_bytes():
    from distlab.theory import collective_bytes_sent
    from torch._C import TensorBase
    book = algorithmic_bytes_booker(TensorBase.numel, TensorBase.element_size, TensorBase.dim, TensorBase.size)
    t = torch.ones(1000)                      # 4000 bytes
    n, me = 4, 1

    class Opts:
        rootRank = 0

    cases = {
        "send": ((([t], 2, 0)), collective_bytes_sent("send", 4000, n)),
        "recv": ((([t], 2, 0)), 0),
        "allreduce": (([t], None), collective_bytes_sent("all_reduce", 4000, n)),
        "broadcast": (([t], None), 4000),
        "_allgather_base": ((torch.ones(4000), t, None), collective_bytes_sent("all_gather", 16000, n)),
        "allgather": (([[t] * n], [t], None), collective_bytes_sent("all_gather", 16000, n)),
        "_reduce_scatter_base": ((t, torch.ones(4000), None), collective_bytes_sent("reduce_scatter", 16000, n)),
        "alltoall_base": ((torch.ones(8, 125), torch.ones(8, 125), [2] * 4, [2] * 4, None), 3000),
        "alltoall": (([t] * n, [t] * n, None), 3 * 4000),
        "gather": (([], [t], Opts()), 4000),
        "barrier": ((None,), 0),
    }
    for name, (args, want) in cases.items():
        assert book(name, args, n, me) == (OP_KINDS[name], want), name
    assert book("send", ([t], 0, 0), 1, 0) == ("send", 4000)       # one rank: a send still sends


# ---------------------------------------------------------------- rank streams and evidence

def _stream(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def test_stream_gives_traffic_per_region_and_evidence():
    raw = _stream("pg\t0\t2\t0", "op\tsend\t4\t0", "region\tbegin\t0\t0", "op\tsend\t4096\t0",
                  "op\trecv\t0\t0", "region\tend\t0\t0", "region\tbegin\t1\t1", "op\tall_reduce\t8\t0",
                  "region\tend\t1\t1", "ev\tsys._getframe\t\t<answer cell ab12 line 3", "end")
    log = evidence.read_stream(raw)
    assert log.regions[0] == CommStats({"send": 1, "recv": 1}, {"send": 4096, "recv": 0})
    assert log.learner_regions == {1} and not log.problem
    assert log.evidence == ["sys._getframe (answer cell ab12 line 3)"]
    problems: list[str] = []
    out = evidence.substitute({"comm": {REGION_KEY: 0}, "x": [{REGION_KEY: 1}, {REGION_KEY: -1}]}, log, problems)
    assert out["comm"] == log.regions[0] and out["x"] == [CommStats(), CommStats()]
    assert problems == ["traffic figures from a meter that learner code opened",
                        "traffic figures that the check's meter did not produce"]


BOOKED = b"kind\tsend\nregion\tbegin\t0\nregion\tend\t0\t{\"send\": 1}\t{\"send\": 1024}\nend\n"


def test_records_a_learner_writes_into_its_stream_never_raise_its_traffic():
    """The stream carries no key: a learner can write into it. On CPU the traffic is the broker's (`BOOKED`):
    traffic records appended to the stream are refused, never counted; a cut, unparseable or re-ended stream is
    refused (the task scores zero); evidence lines a learner adds only ever count against them."""
    honest = _stream("region\tbegin\t0\t0", "region\tend\t0\t0", "end")
    log = evidence.read_stream(honest, broker=BOOKED)
    assert log.problem == "" and log.evidence == [] and log.regions[0] == CommStats({"send": 1}, {"send": 1024})
    for forged, why in [
            (_stream("region\tbegin\t0\t0", "op\tsend\t4096\t0", "region\tend\t0\t0", "end"), "did not write"),
            (_stream("pg\t0\t2\t0", "region\tbegin\t0\t0", "region\tend\t0\t0", "end"), "did not write"),
            (honest + b"region\tbegin\t0", "ends inside a record"),                # a record cut off
            (honest + _stream("end"), "did not write"),                            # a second end
            (_stream("end", "region\tbegin\t0\t0", "region\tend\t0\t0", "end"), "did not write"),
            (honest[: -len(b"end\n")], "ended before the rank returned"),         # closed before the end
            (_stream("region\tbegin\t0\t0\tend", "end"), "did not write"),          # a wrong number of fields
            (b"", "ended before the rank returned")]:
        got = evidence.read_stream(forged, broker=BOOKED)
        assert why in got.problem and got.regions[0] == CommStats({"send": 1}, {"send": 1024}), (forged, got)
    # extra region markers in the stream no longer match the broker's: evidence
    got = evidence.read_stream(_stream("region\tbegin\t7\t0", "region\tend\t0\t0", "end"), broker=BOOKED)
    assert any("do not match the check's" in e for e in got.evidence), got
    # without a broker (NCCL) the stream's traffic is all there is: detected, and a cut one is refused
    assert evidence.read_stream(_stream("op\tsend\t4\t0")).problem.startswith("its audit stream ended before")
    assert "flooded" in evidence.read_stream(honest, flooded=True, broker=BOOKED).problem


def test_evidence_is_summarized_once_per_thing_seen():
    seen = ["rank 0: open /proc/12/fd/1 for writing (answer cell a line 2)",
            "rank 1: open /proc/13/fd/1 for writing (answer cell a line 2)", "rank 1: gc.get_objects"]
    assert summarize(seen) == ["open /proc/<pid>/fd/1 for writing (answer cell a line 2) [ranks 0, 1]",
                               "gc.get_objects [rank 1]"]


# ---------------------------------------------------------------- the shipped lab and the submissions

def test_the_lab_grades_what_its_check_cells_call():
    assert grade_calls('# do not edit\ngrade("all_reduce", ring_all_reduce)\n') == [("all_reduce",
                                                                                   ["ring_all_reduce"])]
    lab = load_lab("01_collectives")
    assert [(g.task.name, g.names) for g in lab.graded] == [
        ("reduce_scatter", ("ring_reduce_scatter",)), ("all_gather", ("ring_all_gather",)),
        ("all_reduce", ("ring_all_reduce",)), ("naive_all_reduce", ("naive_all_reduce",))]
    assert sum(len(g.lines) for g in lab.graded) == 24
    one = load_lab("01_collectives").select(["all_gather, 3 ranks"])
    assert [(g.task.name, g.cases) for g in one.graded] == [("all_gather", (1,))]
    assert one.graded[0].lines == ["all_gather, 3 ranks, values", "all_gather, 3 ranks, traffic"]
    with pytest.raises(ValueError, match="matches"):
        load_lab("01_collectives").select(["no such check"])


def test_answers_are_matched_by_id_then_order_then_name():
    lab = load_lab("01_collectives")
    nb = nbformat.read(ROOT / "labs/01_collectives.ipynb", as_version=4)
    for i, cell in enumerate(c for c in nb.cells if "answer" in c.metadata.get("tags", [])):
        cell.source += f"\n# learner {i}\n%timeit 1"
        cell.id = f"renamed{i}"                       # ids lost: order among answer cells
    cells = submission._cells(json.loads(nbformat.writes(nb)))
    got, missing = submission.answers(lab, cells)
    assert not missing and [src.endswith(f"# learner {i}\n# (ignored by distlab grade) %timeit 1")
                            for i, (_, src) in enumerate(got)] == [True] * 4
    for cell in nb.cells:
        cell.metadata["tags"] = []                    # tags lost too: found by the names they define
    nb.cells = [c for c in nb.cells if "def ring_all_gather" not in c.source]
    got, missing = submission.answers(lab, submission._cells(json.loads(nbformat.writes(nb))))
    assert len(got) == 3 and missing == ["no answer cell for ring_all_gather"]


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not a notebook: invalid JSON at line 1"), ('{"cells": 3}', "not a notebook: no list of cells"),
    ("", "not a notebook: invalid JSON"), ("[" * 100_000, "not a notebook"),
    ('{"cells": [], "pad": "' + "x" * (21 << 20) + '"}', "the file is 21 MiB (limit 20 MiB)")])
def test_files_that_are_not_notebooks_get_a_one_line_reason(tmp_path, text, reason):
    path = tmp_path / "sub.ipynb"
    path.write_text(text)
    with pytest.raises(submission.BadSubmission) as info:
        submission.read(path)
    assert str(info.value).startswith(reason) and "\n" not in str(info.value)


def test_each_lab_names_its_library_shortcuts_and_the_grader_finds_them_in_the_source():
    from distlab.grading import shortcuts
    labs = set(__import__("distlab.checks", fromlist=["LABS"]).LABS)
    assert labs <= set(shortcuts.SHORTCUTS)
    assert shortcuts.named("02_ddp", ["from torch.nn.parallel import DistributedDataParallel as D"]) == [
        "your answer cells use DistributedDataParallel: this lab asks you to write it yourself"]
    assert shortcuts.named("03_zero1", ["opt = torch.distributed.optim.ZeroRedundancyOptimizer(ps, Adam)"]) == [
        "your answer cells use ZeroRedundancyOptimizer: this lab asks you to write it yourself"]
    assert shortcuts.named("08_pipeline", ["from torch.distributed.pipelining import pipeline"]) != []
    # lab 03's LossScaler wrapping torch's own scaler, plain or FSDP2's sharded one
    assert shortcuts.named("03_zero1", ["self.inner = torch.amp.GradScaler('cpu')"]) == [
        "your answer cells use GradScaler: this lab asks you to write it yourself"]
    assert shortcuts.named("03_zero1", ["from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler"]) != []
    assert shortcuts.named("07_tensor_parallel", ["parallelize_module(m, mesh, plan)"]) != []
    # lab 9's stand-in ZeRO-3 ships in the package: it answers none of the labs that build a ZeRO
    assert shortcuts.named("05_zero3", ["from distlab.checks.ch09 import GradingZeRO3 as ZeRO3"]) == [
        "your answer cells use GradingZeRO3: this lab asks you to write it yourself"]
    # a comment or a string is not a use; lab 6 is the FSDP lab; every solution names none of its own
    assert shortcuts.named("02_ddp", ["# unlike DistributedDataParallel\nx = 'DistributedDataParallel'"]) == []
    assert shortcuts.named("06_fsdp", ["fully_shard(model)"]) == []
    for lab in sorted(labs):
        answers, _ = submission.answers(load_lab(lab), submission.read(ROOT / "solutions" / f"{lab}.ipynb"))
        assert shortcuts.named(lab, [src for _, src in answers]) == [], lab


# ---------------------------------------------------------------- the sandbox's view

def test_the_sandbox_shows_the_environment_and_the_package_only():
    argv = sandbox.argv()
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind", "--dev-bind")]
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent", "--clearenv"):
        assert flag in argv
    if sandbox.as_root():      # no user namespace (uid 65534 in one would be root outside): the runner drops
        assert "--unshare-user" not in argv and argv[argv.index("--cap-add") + 1] == "CAP_SETUID"
    else:
        assert "--unshare-user" in argv and "--cap-add" not in argv
    # bwrap (as root) would create the folders above each bound root 0700: the unprivileged uid could not pass
    # (a checkout under /tmp, as CI's clone, included: the runner's uid could not enter it, and every case failed)
    made = {argv[i + 3] for i in range(len(argv) - 3) if argv[i:i + 3] == ["--perms", "0755", "--dir"]}
    for parent in sandbox._parents(sandbox._read_only_roots()):
        assert parent == "/tmp" or parent.startswith(("/usr/", "/etc/")) or parent in made, parent
    assert str(ROOT / "distlab") in binds or all(not b.startswith(str(ROOT)) for b in binds)
    assert not any(b == str(ROOT) or b.startswith(str(ROOT / "solutions")) or b.startswith(str(ROOT / "labs"))
                   or b.startswith(str(ROOT / "tests")) for b in binds), binds
    assert argv[argv.index("--tmpfs") - 2: argv.index("--tmpfs") + 2][-1] == "/tmp"
    # the environment and package are bound after the private /tmp, so a checkout under /tmp stays visible
    roots = [i for i, a in enumerate(argv) if a == "--ro-bind" and argv[i + 1] in sandbox._read_only_roots()]
    assert roots and min(roots) > argv.index("--tmpfs")


def test_limits_reach_the_runner_and_count_the_account_s_own_processes_when_not_root(monkeypatch):
    job = sandbox.Limits(procs=100, memory_bytes=1 << 30).job(cap_s=60)
    assert job["max_memory"] == 1 << 30 and job["max_cpu_s"] == 60
    assert job["max_procs"] == 100 if sandbox.as_root() else job["max_procs"] > 100
    monkeypatch.setattr(sandbox, "as_root", lambda: False)
    assert sandbox.Limits(procs=100).job(60)["max_procs"] > 100      # RLIMIT_NPROC counts them all


# ---------------------------------------------------------------- reports

def test_reports_give_one_row_per_student_a_gradebook_and_the_audit_column(tmp_path):
    from distlab.grading.report import write_reports
    long = "SyntaxError: invalid syntax (line 12: def f(x) return x) " + "x" * 300 + " the useful end"
    results = [Result("h/a.ipynb", [Verdict("x, 2 ranks, values", 1, 1, task="x"),
                                    Verdict("x, 2 ranks, traffic", 0, 1, long, task="x", how="detected"),
                                    Verdict("y, 2 ranks, values", 2, 2, task="y")], seconds=12.4),
               Result("h/b.ipynb", [Verdict("x, 2 ranks, values", 0, 1, "audit: gc.get_objects", task="x",
                                            how="detected")], flags=["x: gc.get_objects [rank 0]"]),
               Result("h/c.ipynb", note="not a notebook: invalid JSON at line 1 column 2 (Expecting value)")]
    write_reports(results, tmp_path, lab="01_collectives")
    rows = list(csv.reader(open(tmp_path / "grades.csv")))
    assert rows == [["student", "x", "y", "total", "max", "note"], ["a", "1", "2", "3", "4", ""],
                    ["b", "0", "", "0", "1", ""], ["c", "", "", "0", "0", results[2].note]]
    lines = list(csv.DictReader(open(tmp_path / "lines.csv")))
    assert [(r["submission"], r["points"]) for r in lines if r["check"] == "TOTAL"] == [
        ("h/a.ipynb", "3"), ("h/b.ipynb", "0"), ("h/c.ipynb", "0")]
    md = (tmp_path / "grades.md").read_text()
    assert "| h/b.ipynb | 0 | 1 | 0/1 | x, 2 ranks, values: audit: gc.get_objects | x: gc.get_objects [rank 0] |" in md
    page = (tmp_path / "grades.html").read_text()
    # students x tasks, coloured; the whole reason on expansion, with enforced/detected; the time
    assert "<td class='part'><details><summary>1/2</summary>" in page and "<td class='pass'><details><summary>2/2" in page
    assert "the useful end <span class='how'>[detected]</span>" in page and "[enforced]" in page
    assert "<td>12 s</td>" in page and "x: gc.get_objects [rank 0]" in page
    suites = ET.parse(tmp_path / "junit.xml").getroot().findall("testsuite")
    assert [s.get("failures") for s in suites] == ["1", "1", "0"]


def test_verdict_lines_say_whether_they_are_enforced_or_detected():
    from distlab.grading.grade import how
    assert how("reduce_scatter, 2 ranks, values") == "enforced"
    assert how("reduce_scatter, 2 ranks, traffic") == how("zero3, peak") == "detected"
    # traffic the ranks' brokers booked (CPU/gloo) is enforced; memory stays detected
    assert how("reduce_scatter, 2 ranks, traffic", brokered=True) == "enforced"
    assert how("zero3, peak", brokered=True) == "detected"
    assert how("reduce_scatter, 2 ranks, values", audited=True) == "detected"


# ---------------------------------------------------------------- the audit hook, in a child process

HOOK_SCRIPT = '''
import os, sys, tempfile, threading, time
from distlab.grading import audithook
from distlab.grading.evidence import read_stream
path = os.path.join(tempfile.mkdtemp(), "events")
os.mkfifo(path)
fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
audithook.install(path, {}, ("distlab.checks.verdict",))
ns = {}
exec(compile(open(sys.argv[1]).read(), "<answer cell t1>", "exec"), ns)
ns["later"]()          # as a check calls the learner's function: no learner frame below it
time.sleep(0.2)
print("EVIDENCE", repr(read_stream(os.read(fd, 1 << 20)).evidence))
'''

LEARNER = '''
import json, math, email.mime.text               # imports of library modules: not evidence
json.loads("[1]")
open(math.__file__ if hasattr(math, "__file__") else json.__file__).close()   # reading the library: fine
_b = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
getattr(_b["__imp" + "ort__"]("s" + "ys"), "_get" + "frame")(0)
_b["__imp" + "ort__"]("g" + "c").get_referrers(json)
import distlab.checks.verdict as v
v.compare.__code__ = (lambda *a, **k: "exact").__code__
open("/proc/self/status").read()
exec(compile("x = 1", v.__file__, "exec"))
threading = _b["__imp" + "ort__"]("threading")
threading.Thread(target=lambda: None).start()
import sys
try:
    sys.audit("distlab.finish", "0" * 64)
except RuntimeError:
    pass
# the rank's own temporary files are its business (a checkpoint, lab 09); the runner's folder is not
import os, tempfile
_d = tempfile.mkdtemp(prefix="ckpt-")
with open(os.path.join(_d, "shard.pt.tmp"), "wb") as _f:
    _f.write(b"x")
os.rename(os.path.join(_d, "shard.pt.tmp"), os.path.join(_d, "shard.pt"))
os.mkdir(os.path.join(tempfile.gettempdir(), "distlab-runner-x" + str(os.getpid())))
# code under a name the interpreter's frozen modules use is still the learner's (issue 38)
exec(compile("def later():\\n    import gc\\n    gc.get_objects()\\n", "<frozen later>", "exec"), globals())
'''


def test_the_audit_hook_records_what_learner_code_does_and_not_what_the_library_does(tmp_path):
    (tmp_path / "hook.py").write_text(HOOK_SCRIPT)
    (tmp_path / "learner.py").write_text(textwrap.dedent(LEARNER))
    run = subprocess.run([sys.executable, str(tmp_path / "hook.py"), str(tmp_path / "learner.py")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    line = next(l for l in run.stdout.splitlines() if l.startswith("EVIDENCE"))
    seen = eval(line[len("EVIDENCE "):])   # noqa: S307 - our own child's repr of a list of str
    text = "\n".join(seen)
    for what in ("sys._getframe", "gc.get_referrers", "object.__setattr__ __code__ (answer cell t1 line 9)",
                 "open /proc/self/status", "exec code under a library file name", "forged distlab.finish",
                 "compile code under a library file name: <frozen later>", "gc.get_objects (-1) (<frozen later line 3)",
                 "os.mkdir (" + str(tmp_path) + "/distlab-runner-x"):
        assert what in text, (what, text, run.stderr[-2000:])
    assert not any(("json" in s or "email" in s or "math" in s) and "open" in s for s in seen), seen
    # compile and exec of each forged file name: two lines each
    assert not any("ckpt-" in s for s in seen), seen
    assert len(seen) == 11, "\n".join(seen)


RANK_IMPORTS_SCRIPT = r"""
import json, os, sys
from distlab.checks.ch01 import RANK_IMPORTS
import distlab
from distlab.grading.runner import _fork_server
for name in (*RANK_IMPORTS, "distlab.grading.rankside", "distlab.grading.safeload", "distlab.checks.verdict"):
    __import__(name)                  # what lab 1's runner imports before it forks its ranks' fork server ...
_fork_server(())                      # ... from itself, as here
from distlab.grading.rankside import run_case

HEAVY = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.pipelining",
         "torch.distributed.optim")


def rank(job, streams):
    preloaded = set(sys.modules)          # what the fork server had
    run_case("01_collectives", job["task"], 0, job["cells"], job["names"], streams, 60)
    return [m for m in HEAVY if m in sys.modules and m not in preloaded]


job = json.loads(sys.stdin.read())
streams = [os.path.join(job["dir"], f"events{r}") for r in range(2)]
for path in streams:
    open(path, "w").close()
print("IMPORTED", json.dumps(distlab.launch(rank, 2, args=(job, streams), backend="gloo")))
"""


def test_lab_1_ranks_import_nothing_beyond_what_its_runner_preloads(tmp_path):
    # `distlab grade` preloads only ch01.RANK_IMPORTS for lab 1 (see distlab/grading/runner.py): a module its
    # ranks import themselves (torch._dynamo: ~3 s of CPU) would be imported again by every rank of every case.
    # One case of the ring task: audit hook, metered group, track_comm and p2p, as every lab-1 case has.
    task = "reduce_scatter"
    lab = load_lab("01_collectives")
    answers, missing = submission.answers(lab, submission.read(ROOT / "solutions" / "01_collectives.ipynb"))
    assert not missing
    names = next(g.names for g in lab.graded if g.task.name == task)
    job = {"task": task, "cells": answers, "names": list(names), "dir": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", RANK_IMPORTS_SCRIPT], input=json.dumps(job), capture_output=True,
                         text=True, timeout=300)
    line = next((l for l in run.stdout.splitlines() if l.startswith("IMPORTED ")), None)
    assert line is not None, run.stdout[-2000:] + run.stderr[-3000:]
    assert json.loads(line[len("IMPORTED "):]) == [[], []], "lab 1's ranks imported these themselves"


# ---------------------------------------------------------------- when bubblewrap is missing or broken

def test_without_bwrap_the_grader_says_so_once_and_what_that_means(monkeypatch):
    from distlab.grading import cli
    said: list[str] = []
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    assert cli.sandbox_for(False, said.append) is None
    assert said == [cli.NO_BWRAP] and "WITHOUT a sandbox" in said[0] and "apt-get install bubblewrap" in said[0]
    said.clear()
    assert cli.sandbox_for(True, said.append) is None and said == [cli.NO_SANDBOX]


def test_a_bwrap_that_cannot_start_a_sandbox_stops_the_run_with_what_to_do(monkeypatch):
    from distlab.grading import cli
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(sandbox, "works", lambda user_ns=True: False)
    with pytest.raises(RuntimeError, match="--no-sandbox"):
        cli.sandbox_for(False, print)


def test_the_cli_says_what_is_missing_and_grades_nothing(tmp_path, capsys):
    from distlab.apps.cli import main
    (tmp_path / "empty").mkdir()
    for argv, words in ((["01_collectives"], "give at least one submission"),
                        (["01_collectives", str(tmp_path / "nope")], f"no such file or folder: {tmp_path / 'nope'}"),
                        (["01_collectives", str(tmp_path / "empty")], "holds no notebook (.ipynb)"),
                        (["99_nothing", str(tmp_path / "empty"), "--self"], "no shipped lab called '99_nothing'")):
        assert main(["grade", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("distlab grade: ") and words in err, err
    assert not (tmp_path / "grades").exists() and not Path("grades").exists()


def test_references_run_on_the_graded_backend(monkeypatch):
    """`distlab grade --backend gloo` on a GPU box: a reference that launches its own ranks (chapter 8's
    offload step, chapter 3's step) must run on gloo too, not on NCCL because the box has GPUs."""
    import os

    from distlab.grading import grade as grade_mod
    seen = []
    monkeypatch.delenv("DISTLAB_BACKEND", raising=False)
    monkeypatch.setattr(grade_mod, "_prepare", lambda *a, **k: seen.append(os.environ.get("DISTLAB_BACKEND")))
    grade_mod.prepare("01_collectives", backend="gloo")
    grade_mod.prepare("01_collectives", backend="auto")
    assert seen == ["gloo", None] and "DISTLAB_BACKEND" not in os.environ


def test_metered_nccl_group_runs_batch_isend_irecv_grouped(monkeypatch):
    """On the metered NCCL group (a Python ProcessGroup) torch's batch_isend_irecv would issue the ops one by
    one, and a ring of receive-then-send deadlocks on NCCL ungrouped. The grader's version brackets them with
    the real group's start/end of coalescing and returns NCCL's one Work (issue 23, a likely point)."""
    import torch
    import torch.distributed as dist

    from distlab.grading import pgmeter
    calls = []
    group = pgmeter.MeteredGroup(0, 2, "metered_nccl")
    monkeypatch.setattr(group, "_op", lambda name, args: calls.append((name, args)) or f"work:{name}",
                        raising=False)
    monkeypatch.setattr(dist, "isend", lambda t, group=None, tag=0, group_dst=None: group.send([t], group_dst, tag))
    monkeypatch.setattr(dist, "irecv", lambda t, group=None, tag=0, group_src=None: group.recv([t], group_src, tag))
    monkeypatch.setattr(dist.distributed_c10d, "_check_p2p_op_list", lambda ops: None)
    ops = [type("P2POp", (), {"op": staticmethod(fn), "tensor": torch.zeros(2), "group": group, "tag": 0, "group_peer": 1})()
           for fn in (dist.irecv, dist.isend)]
    works = pgmeter.grouped_batch_isend_irecv(lambda ops: ["ungrouped"])(ops)
    assert works == ["work:_end_coalescing"]
    assert [name for name, _ in calls] == ["_start_coalescing", "recv", "send", "_end_coalescing"]
    # A metered gloo group keeps torch's path (gloo has no coalescing).
    assert pgmeter.grouped_batch_isend_irecv(lambda ops: ["ungrouped"])(
        [type("Op", (), {"group": pgmeter.MeteredGroup(0, 2, "metered_gloo")})()]) == ["ungrouped"]


def test_sandbox_creates_nvidia_uvm_before_binding_gpu_nodes(monkeypatch):
    """The driver makes /dev/nvidia-uvm at a process's first CUDA call: the sandbox asks for one first where
    the driver is present and uvm is not, so the node exists to be bound (issue 23, a likely point)."""
    import glob as glob_mod
    import os
    import subprocess

    from distlab.grading import sandbox
    nodes = {"/dev/nvidia0", "/dev/nvidiactl"}
    monkeypatch.setattr(os.path, "exists", lambda p: p in nodes)
    monkeypatch.setattr(glob_mod, "glob", lambda pattern: sorted(nodes))
    ran = []

    def run(cmd, **kw):
        ran.append(cmd[-1])
        nodes.update({"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"})
    monkeypatch.setattr(subprocess, "run", run)
    assert sandbox.gpu_nodes() == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl"]
    assert len(ran) == 1 and "cuda" in ran[0]
    assert sandbox.gpu_nodes() and len(ran) == 1       # uvm exists now: no second CUDA call


# The nbval path's hand-ins are data (no conftest.py or test_*.py beside them is imported, items named by task):
# tests/test_grading_class.py::test_instructors_grade_through_nbval_on_the_same_engine, in its graded run.

FAKE_NCCL_SCRIPT = r"""
import os, sys, tempfile, types
from datetime import timedelta
import torch, torch.distributed as dist
calls = []

class Options(dist.ProcessGroupGloo._Options):
    # a real Backend's options (ProcessGroupNCCL.Options is one too): the hook sets its _timeout
    def __init__(self):
        super().__init__()
        self._devices = [dist.ProcessGroupGloo.create_default_device()]

class Recording:
    # ProcessGroupNCCL as torch binds it: a Backend, built with Options; its coalescing takes no device
    def __init__(self, store, rank, size, options):
        calls.append(("created", options._timeout))
    def _start_coalescing(self):
        calls.append(("start",))
    def _end_coalescing(self):
        calls.append(("end",))
        return "one work"
    def send(self, tensors, dst, tag):
        calls.append(("send", dst))
        return "a send"

class RealBinding(dist.ProcessGroupGloo):
    # the C++ bindings ProcessGroupNCCL shares (Backend._start_coalescing(self), no device), on one gloo rank
    def __init__(self, store, rank, size, options):
        super().__init__(store, rank, size, options)
        calls.append(("real", self.options._timeout))

class StandIn:
    # dist.ProcessGroupNCCL for the hook: the recording fake without a store, the real binding with one
    Options = Options
    def __new__(cls, store, rank, size, options):
        return (Recording if store is None else RealBinding)(store, rank, size, options)

dist.ProcessGroupNCCL = StandIn
from distlab.grading import audithook, pgmeter
path = os.path.join(tempfile.mkdtemp(), "events")
os.mkfifo(path)
fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
audithook.install(path, {"distlab.pg.op": pgmeter.MeteredGroup._op.__code__,
                         "distlab.pg.create": pgmeter.create.__code__}, ())
opts = types.SimpleNamespace(group_rank=0, group_size=2, store=None, timeout=timedelta(seconds=5),
                             global_ranks_in_group=[0, 1])
group = pgmeter.create(opts, backend_name="metered_nccl")
device = torch.device("cpu")
group._start_coalescing(device)
group.send([torch.zeros(2)], 1, 0)
print("CALLS", calls, group._end_coalescing(device))
real = pgmeter.create(types.SimpleNamespace(group_rank=0, group_size=1, store=dist.HashStore(),
                                            timeout=timedelta(seconds=5), global_ranks_in_group=[0]),
                      backend_name="metered_nccl")
try:
    real._start_coalescing(device)
except Exception as exc:
    print("REAL", calls[-1], type(exc).__name__, str(exc).splitlines()[0])
"""


def test_the_metered_nccl_group_coalesces_on_a_backend_and_times_out_with_the_launcher_s_nccl_timeout(tmp_path):
    """ProcessGroupNCCL is a Backend (torch 2.13's bindings: Backend._start_coalescing takes no device, as shown on
    gloo's, which shares the binding; ProcessGroup's takes one). With a fake NCCL: a graded ring's batch_isend_irecv
    reaches it without a TypeError, and the graded group's timeout is the stall window (a hung graded submission on
    GPUs is reported by NCCL's watchdog, not left spinning to the cap). With the real Backend binding in its place
    (on one gloo rank), the hook's call reaches C++ (gloo does not coalesce: its own RuntimeError, no TypeError)."""
    from datetime import timedelta

    from distlab.engine.runtime import group_timeout_s
    c10d = torch._C._distributed_c10d
    assert c10d.Backend._start_coalescing.__doc__.startswith("_start_coalescing(self: torch._C._distributed_c10d.Backend) -> None")
    assert "device_type: torch.device" in c10d.ProcessGroup._start_coalescing.__doc__
    run = subprocess.run([sys.executable, "-c", FAKE_NCCL_SCRIPT], capture_output=True, text=True, timeout=120)
    lines = {l.split(" ", 1)[0]: l for l in run.stdout.splitlines()}
    assert "CALLS" in lines and "REAL" in lines, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines["CALLS"] == "CALLS " + repr([("created", timedelta(seconds=5)), ("start",), ("send", 1), ("end",)]) \
        + " one work", lines["CALLS"]
    assert lines["REAL"] == "REAL " + repr(("real", timedelta(seconds=5))) + \
        " RuntimeError Backend gloo does not implement startCoalescing", lines["REAL"]
    from distlab.engine.watchdog import nccl_timeout_s
    assert group_timeout_s("nccl", 180, 5) == nccl_timeout_s(5) < 180 and group_timeout_s("gloo", 180, 5) == 180


@pytest.mark.parametrize("launched", ["nccl", "gloo"])
def test_the_graded_group_is_re_created_with_the_launcher_s_timeout(monkeypatch, launched):
    """A rank launched on NCCL re-creates its default group as `metered_nccl` with the launcher's NCCL timeout (the
    stall window, with its floor: NCCL's watchdog reports a hung graded submission), on gloo as `metered_gloo`
    with the case's cap (gloo blocks with the CPU idle, and the launcher sees that)."""
    from datetime import timedelta

    import torch.distributed as dist

    from distlab.engine.watchdog import nccl_timeout_s
    from distlab.grading import rankside
    got, registered = {}, {}
    monkeypatch.setattr(dist, "get_backend", lambda *a: launched)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: dist.HashStore())
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: None)
    monkeypatch.setattr(dist.Backend, "register_backend", lambda name, fn, **kw: registered.update({name: kw}))
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: got.update(name=name, timeout=kw["timeout"]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    rankside._metered_group(180, 5)
    if launched == "nccl":
        assert got == {"name": "metered_nccl", "timeout": timedelta(seconds=nccl_timeout_s(5))}
        assert registered.get("metered_nccl", {}).get("devices") == ["cuda", "cpu"], registered
    else:
        assert got == {"name": "metered_gloo", "timeout": timedelta(seconds=180)}


def test_the_metered_group_takes_what_torch_passes_by_keyword(monkeypatch):
    """`dist.barrier` calls `group.barrier(opts=opts)`: a graded rank's barrier raised TypeError (lab 09's
    checkpoint answer waits on one)."""
    from distlab.grading import pgmeter
    group, calls = pgmeter.MeteredGroup(0, 2, "metered_gloo"), []
    monkeypatch.setattr(group, "_op", lambda name, args: calls.append((name, args)) or "work", raising=False)
    assert group.barrier(opts="options") == "work" and calls == [("barrier", ("options",))]


def test_a_call_crosses_to_the_broker_as_json_and_bytes_and_comes_back_the_same():
    """What a rank sends its broker (`distlab.grading.broker`): no pickle; tensors, options and reduce ops rebuilt."""
    import torch.distributed as dist

    from distlab.grading import broker
    c10d = torch._C._distributed_c10d
    opts = c10d.ReduceOptions()
    opts.reduceOp, opts.rootRank = dist.ReduceOp.MAX, 1
    call = ([torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int8)], opts, [[torch.zeros(0)]])
    args, blobs = broker.encode_call(call, torch._C.TensorBase, c10d)
    json.dumps(args)
    back = broker.decode_call(args, blobs)
    assert torch.equal(back[0][0], call[0][0]) and torch.equal(back[0][1], call[0][1]) and back[2][0][0].numel() == 0
    assert type(back[1]) is c10d.ReduceOptions and back[1].rootRank == 1 and back[1].reduceOp.op == dist.ReduceOp.MAX
    with pytest.raises(TypeError, match="process-group call got a"):
        broker.encode_call((object(),), torch._C.TensorBase, c10d)
    for bad in ({"O": "Store", "f": {}}, {"R": 99}, {"X": 1}, {"T": 5, "d": "float32", "s": [1]}):
        with pytest.raises((ValueError, IndexError, TypeError, KeyError)):
            broker.decode_call({"L": [bad]}, blobs)
