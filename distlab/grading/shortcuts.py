"""Each lab's library shortcut: what PyTorch already ships for the thing the lab asks the learner to write.

Lab 02 asks for data parallelism by hand, so its answers may not be (or wrap)
`DistributedDataParallel`; lab 03-05's sharded optimizers may not be
`ZeroRedundancyOptimizer` or FSDP, and lab 03's loss scaler not `GradScaler`; lab 07's layers may not be PyTorch's
tensor-parallel styles; lab 08's schedules may not be `torch.distributed.pipelining`.
Lab 01's rings may run point-to-point operations only, in every call of the
check (`ONLY_OPS`, from the ops the audit hook booked); lab 06 is the FSDP lab
itself. Two checks for the others:

- from outside the learner's processes, in the grader: `named(lab, sources)` lists
  the shortcuts the answer cells name (an import, a name or an attribute);
- on the rank, before learner code: `watch(lab, audit)` makes each shortcut's
  `__init__` raise the audit event `distlab.shortcut`, which the hook books as
  evidence when learner code is anywhere on the stack (so names built at run
  time are caught too); the classes are in the hook's snapshot, so unwrapping
  them is evidence as well.
"""
from __future__ import annotations

import ast
import importlib
import sys
from typing import Any

# (module, class whose __init__ every construction runs, the name a learner knows it by)
DDP = ("torch.nn.parallel.distributed", "DistributedDataParallel", "DistributedDataParallel")
ZERO = ("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer")
FSDP1 = ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "FullyShardedDataParallel")
FSDP2 = ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "fully_shard")
TP = tuple(("torch.distributed.tensor.parallel.style", c, c) for c in (
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"))
# Lab 03's loss scaler: torch's (FSDP2's sharded one is a subclass, so its construction runs GradScaler's too).
SCALER = (("torch.amp.grad_scaler", "GradScaler", "GradScaler"),
          ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler", "ShardedGradScaler"))
# Lab 09's stand-in ZeRO-3 (what `distlab grade` gives lab 9's loop): a ZeRO-3 the package ships, so not an answer
# to the labs that build one.
GRADING_ZERO3 = ("distlab.checks.ch09_zero3", "GradingZeRO3", "GradingZeRO3")
PP = (("torch.distributed.pipelining.stage", "_PipelineStageBase", "PipelineStage"),
      ("torch.distributed.pipelining.schedules", "_PipelineSchedule", "ScheduleGPipe"))

SHORTCUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "01_collectives": (),
    "02_ddp": (DDP, FSDP1, FSDP2, ZERO),
    "03_zero1": (ZERO, FSDP1, FSDP2, *SCALER, GRADING_ZERO3),
    "04_zero2": (ZERO, FSDP1, FSDP2, GRADING_ZERO3),
    "05_zero3": (ZERO, FSDP1, FSDP2, GRADING_ZERO3),
    "06_fsdp": (),
    "07_tensor_parallel": TP,
    "08_pipeline": PP,
    "09_training": (),
    "10_moe": (),
}
# The collectives a lab's answers may run at all, in any call of the check (not only in its metered call): lab
# 01's rings are point-to-point, so values computed through a library collective outside the metered call are
# as much a shortcut as inside it.
ONLY_OPS: dict[str, frozenset[str]] = {"01_collectives": frozenset({"send", "recv"})}
# The package's own answers to a lab: (module, its functions that are the answers). Lab 08's schedule tables are
# `simulate`'s order functions (the grader judges with `simulate` itself, outside the ranks); lab 09's
# `rank_windows` is the loader's `rank_rows` (or `global_rows`, sliced); lab 10's `route` and `aux_loss` are the
# layer's `route` and `load_balancing_loss` (the dense `MoE`'s forward calls both, so it answers nothing either;
# no graded rank runs it: the check hands it to the learner's expert-parallel layer for its weights). Inside the
# sandbox each module's file is replaced by a copy whose answers raise (`sandbox.hidden`, enforced: every import
# of them, re-exports such as `distlab.course.training.rank_rows` and the checks' own included); on the rank they
# are also replaced before learner code, wherever a distlab module holds them (`hide`; without a sandbox only
# that, and the file stays readable).
HIDDEN: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "08_pipeline": (("distlab.course.pipeline.simulate", ("interleaved_order", "zero_bubble_order")),),
    "09_training": (("distlab.course.training.loader", ("rank_rows", "global_rows")),),
    "10_moe": (("distlab.course.moe.layer", ("route", "load_balancing_loss")),)}


def _hidden_answer(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("hidden while grading: this lab asks you to write it")


def hide(lab: str) -> None:
    """Replace the package's answers to `lab` (`HIDDEN`) in this process, before learner code: in their module
    and in every distlab module that imported them (a package's re-export, a check module's own import)."""
    for module_name, names in HIDDEN.get(lab, ()):
        module = importlib.import_module(module_name)
        originals = [getattr(module, name) for name in names if hasattr(module, name)]    # alive: ids stay theirs
        answers = {id(fn) for fn in originals}
        for name in names:
            setattr(module, name, _hidden_answer)
        for other in [m for key, m in list(sys.modules.items()) if key.startswith("distlab")]:
            for key, value in list(getattr(other, "__dict__", {}).items()):
                if id(value) in answers:
                    setattr(other, key, _hidden_answer)


def other_ops(lab: str, op_calls: dict[str, int]) -> list[str]:
    """The kinds of collective a rank ran that `lab` does not allow (sorted)."""
    allowed = ONLY_OPS.get(lab)
    return [] if allowed is None else sorted(set(op_calls) - allowed)


# names an answer cell may not mention, per lab (what `named` looks for)
_EXTRA_NAMES = {FSDP2: ("fully_shard",), PP[0]: ("PipelineStage",), PP[1]: (
    "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble", "PipelineScheduleSingle", "PipelineScheduleMulti"), TP[0]: ("parallelize_module",)}


def forbidden_names(lab: str) -> dict[str, str]:
    """Name a learner could write -> the shortcut it stands for."""
    out = {}
    for entry in SHORTCUTS.get(lab, ()):
        for name in (entry[2], *_EXTRA_NAMES.get(entry, ())):
            out[name] = entry[2]
        if entry[1] and not entry[1].startswith("_"):
            out[entry[1]] = entry[2]
    if lab == "08_pipeline":
        out["pipelining"] = "torch.distributed.pipelining"
    return out


def named(lab: str, sources: list[str]) -> list[str]:
    """The shortcuts the answer cells name (in the grader: nothing of theirs runs); one line each."""
    names = forbidden_names(lab)
    if not names:
        return []
    seen: dict[str, None] = {}
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            words = []
            if isinstance(node, ast.Name):
                words = [node.id]
            elif isinstance(node, ast.Attribute):
                words = [node.attr]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                words = [a.name.split(".")[-1] for a in node.names] + (
                    node.module.split(".") if isinstance(node, ast.ImportFrom) and node.module else [])
                for a in node.names:
                    words += a.name.split(".")
            for w in words:
                if w in names:
                    seen[f"your answer cells use {names[w]}: this lab asks you to write it yourself"] = None
    return list(seen)


def _wrapper(original: Any, label: str, audit: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        audit("distlab.shortcut", label)
        original(self, *args, **kwargs)
    return __init__


def watch(lab: str, audit: Any = sys.audit) -> tuple[list[Any], tuple[str, ...]]:
    """Wrap each shortcut's `__init__` so constructing it raises `distlab.shortcut`; (the wrappers' code
    objects, for the hook; the modules to snapshot)."""
    codes, modules = [], []
    for module_name, cls_name, label in SHORTCUTS.get(lab, ()):
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "__distlab_shortcut__", False):
            continue

        __init__ = _wrapper(original, label, audit)
        __init__.__distlab_shortcut__ = True
        __init__.__wrapped__ = original
        type.__setattr__(cls, "__init__", __init__)
        codes.append(__init__.__code__)
        modules.append(module_name)
    return codes, tuple(modules)
