"""Leaving one machine: a lab's training measurement, with the learner's own classes, under torchrun.

`distlab export` writes a job script that calls `main(lab, answers_module)` on
every rank. The same script runs on one node and across nodes:

    torchrun --nproc-per-node 2 job.py --out results/
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 job.py --out results/        # and --node-rank 1 on the other

Each rank trains the course model with the learner's implementation (NCCL
with one GPU per local rank where there are enough GPUs, gloo on CPUs),
measures what the tour measures (samples/s, model-state and peak bytes per
rank, algorithmic bytes sent per step, max |param - one process|) and the
records go where `distlab tour` puts its own: every node writes
`node<K>.jsonl` (its ranks' records), and rank 0 gathers all of them over the
process group and writes `strategies.jsonl`, one record for the whole job.

Failures name the node: a rank that raises prints its rank, node and host
before torchrun stops the job; a watchdog thread per rank publishes its CPU
progress in the rendezvous store, and when no rank anywhere has worked for
the stall window (a collective some ranks skip, a peer node that vanished),
every rank prints where it waits and exits, instead of waiting forever.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist

import distlab
from distlab.engine.runtime import end_rank
from distlab.meters import model_state, sync, track_comm, track_memory
from distlab.course.models import PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch, train_reference
from distlab.theory import comm_bytes_per_rank


@dataclass(frozen=True)
class Strategy:
    """How a lab's answer trains the course model: wrap it, step it, read its full parameters."""

    name: str                 # the record's name
    answer: str               # the learner's class the job needs
    stage: int                # ZeRO stage of the traffic formula (0 = DDP)
    wrap: Callable[[Any, torch.nn.Module, Callable], tuple[Any, Any]]   # (cls, model, make_opt) -> (model, opt)
    after_backward: Callable[[Any], None] = lambda wrapped: None
    full_params: Callable[[Any, torch.nn.Module], dict] = lambda wrapped, model: {
        k: v.detach() for k, v in model.named_parameters()}
    state_of: Callable[[Any, torch.nn.Module, Any], Any] = lambda wrapped, model, opt: model_state(model, optimizer=opt)


def _ddp_wrap(cls: Any, model: torch.nn.Module, make_opt: Callable) -> tuple[Any, Any]:
    wrapped = cls(model, bucket_size_mb=1.0)
    return wrapped, make_opt(model.parameters())


def _zero3_wrap(cls: Any, model: torch.nn.Module, make_opt: Callable) -> tuple[Any, Any]:
    wrapped = cls(model, optimizer=make_opt)
    return wrapped, wrapped.optimizer


STRATEGIES = {
    "02_ddp": Strategy("ddp_learner", "BucketedDDP", 0, _ddp_wrap,
                       after_backward=lambda w: w.finish_gradient_synchronization()),
    "05_zero3": Strategy("zero3_learner", "ZeRO3", 3, _zero3_wrap,
                         full_params=lambda w, model: w.gather_full_params(),
                         state_of=lambda w, model, opt: model_state(w.shards(), optimizer=opt)),
}


def identity() -> dict[str, Any]:
    """Who this rank is, across nodes (torchrun's environment)."""
    return {"rank": distlab.rank(), "world_size": distlab.world_size(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "node": int(os.environ.get("GROUP_RANK",
                                                                                     os.environ.get("NODE_RANK", 0))),
            "host": socket.gethostname(), "backend": distlab.backend(), "device": str(distlab.device())}


# ---- the watchdog: progress across nodes, through the rendezvous store ----------------------------

class Watchdog(threading.Thread):
    """Every `period` s, publish this rank's CPU time in the store and read everyone's. When no rank
    has used more than `min_share` of a core for `stall` s, print where this rank waits and exit.
    A rank whose torchrun agent died exits too (the agent is its parent: a rank left running
    without it would train on alone while the job can no longer end cleanly); its peers then see
    their connections close and fail with their node named."""

    def __init__(self, store: Any, me: dict[str, Any], stall: float, period: float = 2.0, min_share: float = 0.05):
        super().__init__(daemon=True, name="distlab-watchdog")
        self.store, self.me, self.stall, self.period, self.min_share = store, me, stall, period, min_share
        self.done = threading.Event()

    def run(self) -> None:
        n, r = self.me["world_size"], self.me["rank"]
        last_cpu: dict[int, float] = {}
        last_work = time.monotonic()
        agent = os.getppid()
        while not self.done.wait(self.period):
            if os.getppid() != agent:
                self._give_up(lost=False, orphaned=True)
            try:
                self.store.set(f"distlab/cpu/{r}", f"{time.process_time():.3f}")
                cpus = {k: float(self.store.get(f"distlab/cpu/{k}")) for k in range(n)
                        if self.store.check([f"distlab/cpu/{k}"])}
            except Exception:  # noqa: BLE001 - the store's host is gone: so is a node
                if not self.done.is_set():
                    self._give_up(lost=True)
                return
            now = time.monotonic()
            worked = any(v - last_cpu.get(k, v - 1) >= self.min_share * self.period for k, v in cpus.items())
            last_cpu = cpus
            if worked:
                last_work = now
            elif now - last_work >= self.stall:
                self._give_up(lost=False)

    def stop(self, timeout: float = 60.0) -> None:
        """End the watch and wait for its thread: at most one store call (milliseconds) is in flight."""
        self.done.set()
        if self.is_alive():
            self.join(timeout)

    def _give_up(self, lost: bool, orphaned: bool = False) -> None:
        m = self.me
        why = ("its torchrun agent died (the node is going away)" if orphaned else
               "the rendezvous store no longer answers: the node hosting it went away" if lost else
               f"for {self.stall:g} s no rank on any node did any work (a collective or recv some ranks never reach)")
        sys.stderr.write(f"distlab: rank {m['rank']} (node {m['node']}, host {m['host']}, local rank "
                         f"{m['local_rank']}) stopped: {why}. Where it waits:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=False)
        sys.stderr.flush()
        os._exit(3)


# ---- the measurement --------------------------------------------------------------------------

def measure(lab: str, answers: ModuleType, *, preset: str = "small", steps: int = 4, per_rank_batch: int = 4,
            lr: float = 1e-3) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train `steps` steps of `preset` with the learner's class; (this rank's record, full parameters)."""
    strategy = STRATEGIES[lab]
    cls = getattr(answers, strategy.answer, None)
    if cls is None:
        raise AttributeError(f"the exported answers of {lab} define no {strategy.answer}: export the notebook "
                             "in which you wrote it (distlab export LAB NOTEBOOK -o DIR)")
    n, r = distlab.world_size(), distlab.rank()
    batch = per_rank_batch * n
    cfg = PRESETS[preset]

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    with track_memory() as mem:
        model = build_model(preset, seed=0)
        psi = num_params(model)   # before wrapping: ZeRO-3 leaves the model's own parameters empty
        wrapped, opt = strategy.wrap(cls, model, make_opt)
        seconds, comm = [], None
        for step in range(steps):
            x, y = split_batch(synthetic_batch(step, batch, cfg), r, n)
            dist.barrier()
            sync()
            start = time.perf_counter()
            with track_comm() as meter:
                lm_loss(wrapped, x, y).backward()
                strategy.after_backward(wrapped)
            opt.step()
            state = strategy.state_of(wrapped, model, opt) if step == steps - 1 else None
            opt.zero_grad(set_to_none=True)
            sync()
            seconds.append(time.perf_counter() - start)
            comm = meter.stats()
        peak = mem.peak_bytes
    full = {k: v.detach().float().cpu() for k, v in strategy.full_params(wrapped, model).items()}
    timed = sorted(seconds[1:] or seconds)
    return {"name": strategy.name, "lab": lab, **identity(), "num_params": psi, "preset": preset,
            "model_state_bytes": {"params": state.params, "grads": state.grads,
                                  "optimizer_state": state.optimizer_state},
            "predicted_model_state_bytes": 16 * psi / (n if strategy.stage == 3 else 1),
            "peak_bytes": peak, "comm_bytes_per_step": comm.total_bytes,
            "predicted_comm_bytes_per_step": comm_bytes_per_rank(psi, n, strategy.stage, bytes_per_element=4),
            "samples_per_s": batch / timed[len(timed) // 2], "steps": steps}, full


def _diff_vs_reference(params: dict[str, torch.Tensor], preset: str, steps: int, batch: int, lr: float) -> float:
    ref = train_reference(preset, steps=steps, batch_size=batch, lr=lr, optimizer=torch.optim.AdamW)
    return max((params[k] - v).abs().max().item() for k, v in ref.params.items())


def write_records(records: list[dict[str, Any]], params: dict[str, torch.Tensor], out: Path, preset: str,
                  steps: int, batch: int, lr: float) -> None:
    """On each node's local rank 0: node<K>.jsonl; on rank 0: the merged strategies.jsonl
    (`params`: this rank's full trained parameters, compared on rank 0 with one process)."""
    me = identity()
    out.mkdir(parents=True, exist_ok=True)
    mine = [rec for rec in records if rec["node"] == me["node"]]
    if me["local_rank"] == 0:
        with open(out / f"node{me['node']}.jsonl", "a") as f:
            for rec in mine:
                f.write(json.dumps(rec) + "\n")
    if me["rank"] != 0:
        return
    first = records[0]
    merged = {k: v for k, v in first.items() if k not in ("rank", "local_rank", "host", "device")}
    merged.update(nodes=len({rec["node"] for rec in records}), hosts=sorted({rec["host"] for rec in records}),
                  peak_bytes_per_rank=[rec["peak_bytes"] for rec in records],
                  max_abs_param_diff_vs_single=_diff_vs_reference(params, preset, steps, batch, lr))
    with open(out / "strategies.jsonl", "a") as f:
        f.write(json.dumps(merged) + "\n")
    print(f"distlab: {merged['name']} on {merged['world_size']} ranks over {merged['nodes']} node(s): "
          f"{merged['samples_per_s']:.1f} samples/s, {merged['comm_bytes_per_step']} B sent per step per rank "
          f"({_vs_theory(merged['comm_bytes_per_step'], merged['predicted_comm_bytes_per_step'])}), "
          f"max |param - one process| = {merged['max_abs_param_diff_vs_single']:.1e}; records in {out}")


def _vs_theory(measured: float, predicted: float) -> str:
    """measured / predicted as '1.0000x theory'; on one rank both are 0 bytes and there is no ratio to take."""
    if predicted:
        return f"{measured / predicted:.4f}x theory"
    return "theory: 0 on one rank" if not measured else f"theory: 0, yet {measured} B were sent"


def main(labs: str | list[str], answers: ModuleType | list[ModuleType], argv: list[str] | None = None) -> int:
    """The job script's entry point, on every rank under torchrun: each lab's measurement in turn."""
    from torch.distributed.elastic.multiprocessing.errors import record

    labs = [labs] if isinstance(labs, str) else list(labs)
    modules = [answers] if isinstance(answers, ModuleType) else list(answers)
    ap = argparse.ArgumentParser(description=f"{', '.join(labs)}: the learner's implementations under torchrun")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("DISTLAB_RESULTS", "results")))
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--per-rank-batch", type=int, default=4)
    ap.add_argument("--stall", type=float, default=float(os.environ.get("DISTLAB_STALL_S", 60)),
                    help="seconds without work on every rank before the job counts as hung (default 60)")
    args = ap.parse_args(argv)

    @record   # torchrun reports the first failing rank's error with its rank and host
    def job() -> None:
        me = identity()

        def stopped(signum: int, frame: Any) -> None:
            # torchrun's agent ends its ranks with SIGTERM when any rank or node of the job failed
            # (or its rendezvous store went away with another node): say who stopped, and why.
            sys.stderr.write(f"distlab: rank {me['rank']} (node {me['node']}, host {me['host']}, local rank "
                             f"{me['local_rank']}) stopped by its torchrun agent ({signal.Signals(signum).name}): "
                             "a rank or node of this job failed or went away; the first error in the nodes' "
                             "logs names it\n")
            sys.stderr.flush()
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, stopped)
        dog = Watchdog(dist.distributed_c10d._get_default_store(), me, args.stall)
        dog.start()
        if me["local_rank"] == 0:   # this job's node records only (strategies.jsonl is appended to, as the tour's)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"node{me['node']}.jsonl").write_text("")
        try:
            for lab, module in zip(labs, modules):
                rec, params = measure(lab, module, preset=args.preset, steps=args.steps,
                                      per_rank_batch=args.per_rank_batch)
                records: list[Any] = [None] * distlab.world_size()
                dist.all_gather_object(records, rec)   # every node's records reach every rank over the group
                write_records(records, params, args.out, args.preset, args.steps,
                              args.per_rank_batch * me["world_size"], 1e-3)
            dist.barrier()
        except BaseException as exc:
            sys.stderr.write(f"distlab: rank {me['rank']} (node {me['node']}, host {me['host']}, local rank "
                             f"{me['local_rank']}) failed: {type(exc).__name__}: {str(exc)[:500]}\n")
            raise
        finally:
            # Joined, not left running: a daemon thread caught inside a store call when the interpreter
            # finalizes is unwound through C++ and aborts the rank ("terminate called without an active
            # exception", SIGABRT) after its work is done, and torchrun then fails the whole job.
            dog.stop()

    distlab.run_under_torchrun(job)
    end_rank(0)   # never returns: the rank ends without finalizing the interpreter (see end_rank)
    return 0
