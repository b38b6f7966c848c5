"""Checkpoints that survive a fault: `torch.distributed.checkpoint` (DCP) for model and optimizer, a small
JSON beside it for everything else, written to a hidden folder and renamed when complete.

    save(ckpt_dir, step, module, optimizer, meta)      # on every rank, collectively
    latest(ckpt_dir)                                   # the newest complete checkpoint, or None
    meta = load(path, module, optimizer)               # on every rank, at any world size

DCP writes one file per rank plus a `.metadata` index that records, for every tensor, which slice of the
global tensor each file holds. Loading asks for the slices this rank's (possibly differently sharded)
parameters and optimizer states need and reads just those: a checkpoint saved by `fully_shard` on 4 ranks
loads on 2 without gathering anything onto one rank. `get_state_dict` / `set_state_dict` give the same
keys (fully-qualified parameter names) for one process, DDP and `fully_shard`.

The learner's ZeRO-3 (`distlab.course.zero.units.ShardedModule`, lab 5) is not DCP's kind of module: its
shards are plain tensors that every rank names alike, and DCP would keep one copy of them. Each rank saves its
own `state_dict()` and its optimizer's with `torch.save` (`rank{r}.pt`), and loads them back at the same world
size (resharding flat shards by hand is lab 9's `load_shard`).

A pipeline (strategy `pp`) saves through DCP too, under the whole model's names (`Pipeline.named`) and with
AdamW's state flattened per parameter (`StateDictOptions(flatten_optimizer_state_dict=True)`, as torchtitan
does for its pipeline stages): every key then names one parameter of the whole model, held by whichever
stage has it, so a pp checkpoint loads at another world size (another split of the blocks). The other
strategies keep the default layout; the loop refuses to cross between the two (`loop.foreign`).

A checkpoint is first written to `.step_000040.tmp/` and renamed to `step_000040/` only after every rank has
finished writing (a barrier, then rank 0's `os.replace`, atomic on one file system): a rank killed during
a save leaves only a hidden folder that `latest` never picks.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

META = "distlab.json"
_STEP = re.compile(r"^step_(\d+)$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


@contextlib.contextmanager
def _unaudited() -> Iterator[None]:
    """DCP plans a save with object collectives (`gather_object`, `broadcast_object_list`), whose pickled bytes
    torch itself stages on the device the backend needs (the CPU under gloo, the GPU under NCCL). The device
    audit (a torch-function mode) cannot tell torch's own staging from a learner's
    forgotten `device=`, so DCP runs with it set aside; the model's and optimizer's tensors are the rank's
    own, placed as training placed them."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
    stack = _get_current_function_mode_stack()            # innermost last
    audits = [m for m in stack if type(m).__name__ == "_FunctionAudit"]
    if not audits:
        yield
        return
    for _ in stack:
        _pop_mode()
    for m in stack:
        if m not in audits:
            _push_mode(m)                                  # the others (the strict backend's) stay on
    try:
        yield
    finally:
        for _ in range(len(stack) - len(audits)):
            _pop_mode()
        for m in stack:
            _push_mode(m)


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what the run is."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _per_rank(module: torch.nn.Module) -> bool:
    """The learner's ZeRO-3: each rank saves and loads its own file (see the module's docstring)."""
    from distlab.course.zero.units import ShardedModule
    return isinstance(module, ShardedModule)


def _state_dict_args(module: Any) -> tuple[torch.nn.Module, Any]:
    """(the module DCP's state-dict helpers see, their options): a pipeline's stage under the whole model's
    names with its optimizer state flattened per parameter; any other module as it is, default options."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from distlab.course.training.pp import Pipeline
    if isinstance(module, Pipeline):
        return module.named, StateDictOptions(flatten_optimizer_state_dict=True)
    return module, None


def _barrier() -> None:
    if _dist():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This rank's random state (CPU, and CUDA when present), as lists that JSON can hold."""
    out = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def save(ckpt_dir: str | Path, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any]) -> Path:
    """Save model, optimizer and `meta` (JSON: loader position, config, losses...) as step `step`; every
    rank's RNG state is added to `meta["rng"]` (a list by rank). Collective: call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    root = Path(ckpt_dir)
    final, tmp = root / f"step_{step:06d}", root / f".step_{step:06d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)    # the remains of a save that was killed
    _barrier()
    rngs = [rng_state()]
    with _unaudited(), _one_process_quietly():
        if _per_rank(module):
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save({"model": module.state_dict(), "optim": optimizer.state_dict()}, tmp / f"rank{_rank()}.pt")
        else:
            named, options = _state_dict_args(module)
            model_sd, optim_sd = get_state_dict(named, optimizer, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if _dist():
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng_state())
    if _rank() == 0:
        (tmp / META).write_text(json.dumps({**meta, "step": step, "rng": rngs}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)                    # complete, or not there at all
    _barrier()
    return final


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `ckpt_dir` (hidden `.tmp` folders are never complete)."""
    root = Path(ckpt_dir)
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP.match(p.name)) and (p / META).exists()]
    return max(found)[1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def load(path: str | Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model and optimizer state in place (resharded to this run's world size and strategy), restore
    this rank's RNG state (rank r takes saved rank r's, or rank 0's when the new world is larger); return
    the checkpoint's meta. Collective: call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if _per_rank(module):
        mine = Path(path) / f"rank{_rank()}.pt"
        if not mine.exists():
            raise ValueError(f"rank {_rank()}: {path} holds no rank{_rank()}.pt: a ZeRO-3 checkpoint (one file per "
                             "rank) resumes at the world size that saved it")
        state = torch.load(mine, map_location=next(module.parameters()).device, weights_only=False)
        module.load_state_dict(state["model"])          # refuses another rank's or world size's layout
        optimizer.load_state_dict(state["optim"])
    else:
        named, options = _state_dict_args(module)
        model_sd, optim_sd = get_state_dict(named, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        with _unaudited(), _one_process_quietly():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(named, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    meta = read_meta(path)
    rngs = meta["rng"]
    set_rng_state(rngs[_rank()] if _rank() < len(rngs) else rngs[0])
    return meta


def time_saves(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path,
               repeats: int = 2) -> dict[str, float]:
    """Seconds a rank spends in a blocking `dcp.save` and in `dcp.async_save` (until it returns, and until
    its future completes), the least of `repeats` each (the first async save also sets up its thread).
    Collective: call on every rank."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from distlab.meters.timing import sync
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    out = {"blocking_s": [], "async_return_s": [], "async_done_s": []}
    with _unaudited():
        # async_save's background thread runs its own collectives: a gloo group of its own, off the training one
        group = dist.new_group(backend="gloo") if _dist() else None
        for k in range(repeats):
            sync(); _barrier()
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=str(Path(folder) / f"blocking_{k}"))
            out["blocking_s"].append(time.perf_counter() - start)
            _barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(Path(folder) / f"async_{k}"), process_group=group)
            out["async_return_s"].append(time.perf_counter() - start)    # training could go on from here
            future.result()
            out["async_done_s"].append(time.perf_counter() - start)
    return {k: min(v) for k, v in out.items()}
