"""The device audit: on CPU ranks, enforce the rule a GPU enforces.

On a GPU, a tensor created without `device=` lands on the CPU, and the first
collective or the first op that mixes it with the rank's CUDA tensors raises.
On CPU ranks every tensor is on the CPU, so the same bug passes silently and
only shows up on a learner's workstation. Under the audit it raises here too:

    DISTLAB_DEVICE_AUDIT=1 jupyter ...          # every launch audits
    distlab.engine.launch.run_on_ranks(fn, 2, audit=True)   # one launch audits

Each tensor is classed by where it came from:

- *placed*: created with an explicit device (not the literal string "cpu"),
  moved with `.to(device)` / `.cuda()` / `module.to(device)`, or computed
  from a placed tensor;
- *host*: created without a device (`torch.zeros(n)`, `torch.tensor(...)`,
  a fresh `nn.Linear`), or explicitly on "cpu" / `.cpu()`, or computed from
  host tensors only. On a GPU these are CPU tensors;
- unknown: made before the audit began, or by C++ code (DDP's buckets).

A host tensor with more than one element may not enter a collective or meet a
placed tensor in an op (`copy_`, `.to` and item access excepted, as on a GPU).
Under the strict backend (`DeviceAudit(strict=True)`) no host tensor may enter a
collective, whatever its size: NCCL refuses 0-dim and 1-element CPU tensors too
(only ops, not collectives, accept a 0-dim CPU tensor beside CUDA ones). Tensors
that reach a rank as `launch()` arguments are host tensors (on a GPU box they
arrive on the CPU).
A violation raises `DeviceAuditError` on the rank, naming the op, the shape and
the line that created the host tensor. `fully_shard` without `mesh=` is
refused too: it builds its mesh on the machine's accelerator type, not on the
rank's device (on a GPU box with gloo ranks, every rank lands on cuda:0).

`lint_source` finds, in notebook code, timings a GPU would make meaningless:
a bare `time.perf_counter()` / `time.time()` measures how fast kernels were
queued, not how fast they ran (use `distlab.meters.time_call`, `PhaseTimer`
or `distlab.bench.race`).
"""
from __future__ import annotations

import ast
import importlib
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


PLACED, HOST = "placed", "host"

# Factories: where the result lives is decided by their `device=` argument.
_FACTORIES = {
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
    "logspace", "eye", "tensor", "as_tensor", "scalar_tensor", "empty_strided", "from_numpy", "frombuffer",
    "sparse_coo_tensor", "normal", "tril_indices", "triu_indices", "bartlett_window", "hann_window",
}
# Ops that may legally take tensors on two devices (the GPU rule has these exceptions).
_MIXING_ALLOWED = {"copy_", "to", "cpu", "cuda", "__setitem__", "set_", "item", "tolist", "numpy", "__get__",
                   "__set__", "__repr__", "__format__", "__str__", "equal", "size", "dim", "numel", "stride",
                   "data_ptr", "untyped_storage", "element_size", "__len__", "register_hook", "is_floating_point"}
# Collectives, as this mode sees them: torch.distributed's Python API (each call, p2p included, goes
# through torch's function modes) and the c10d operators called directly (functional collectives).
# What C++ issues by itself (DDP's bucket all-reduces, on buffers it allocates) is not seen.
_C10D = "torch.distributed.distributed_c10d"
_C10D_OPS = ("c10d", "_c10d_functional")
_SKIP_FILES = (os.sep + "torch" + os.sep, os.sep + os.path.join("distlab", "engine", "audit.py"), "contextlib.py",
               os.sep + "site-packages" + os.sep + "typing_extensions")


class DeviceAuditError(RuntimeError):
    """A tensor without the rank's device met a placed tensor or a collective."""


def _where() -> str:
    """'file:line in fn' of the innermost frame outside torch and this module."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP_FILES):
            return f"{_short(name)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "an unknown line"


def _short(path: str) -> str:
    if "ipykernel" in path:
        return "a notebook cell"
    parts = path.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 1 else path


def _is_host_device(device: Any) -> bool:
    """True for device=None (the default) and the literal string 'cpu': on a GPU box that is the CPU."""
    return device is None or (isinstance(device, str) and device.split(":")[0] == "cpu")


class _Book:
    """Class of each tensor, and where host tensors were born: kept as attributes of the tensor
    object itself, so they die with it (a view is a new object, classed from its base)."""

    @staticmethod
    def born(t: torch.Tensor) -> str:
        return (t.__dict__.get("_distlab_born") if hasattr(t, "__dict__") else None) or "an unknown line"

    @staticmethod
    def mark(t: torch.Tensor, kind: str, born: str | None = None) -> None:
        try:
            t.__dict__["_distlab_place"] = kind
            t.__dict__["_distlab_born"] = born
        except (AttributeError, TypeError):
            pass


def _describe(t: torch.Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)} ({t.dtype})"


def _tensors(x: Any, out: list | None = None, depth: int = 0) -> list:
    """The tensors in an op's arguments or result (lists, tuples, dicts, nested). Not torch's pytree: this
    runs on every torch call of an audited rank, and the generic walk was about a third of the audit's own
    time per call (profiled on a lab-1 rank); containers are entered, other elements only type-checked."""
    out = [] if out is None else out
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif depth < 8 and isinstance(x, (list, tuple, dict)):
        for v in (x.values() if isinstance(x, dict) else x):
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple, dict)):
                _tensors(v, out, depth + 1)
    return out


def _place(t: torch.Tensor) -> str | None:
    try:
        return t.__dict__.get("_distlab_place")
    except AttributeError:
        return None


class _FunctionAudit(TorchFunctionMode):
    """Sees every torch call with its original arguments: classes results, refuses mixing."""

    def __init__(self, book: _Book, strict: bool = False) -> None:
        super().__init__()
        self.book = book
        # The smallest host tensor a collective refuses: NCCL refuses every one; the plain audit lets
        # 0-dim and 1-element ones through (gloo-era code that NCCL's strict run still catches).
        self.min_numel = 1 if strict else 2

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        module = getattr(func, "__module__", None) or ""
        if module == _C10D or (module.startswith("torch._ops") and _namespace(func) in _C10D_OPS):
            for t in _tensors(kwargs, _tensors(args)):
                if _place(t) == HOST and t.numel() >= self.min_numel:
                    raise DeviceAuditError(
                        f"device audit: the collective {name} got a {_describe(t)} created "
                        f"without a device at {self.book.born(t)}. Under NCCL every tensor "
                        "of a collective must be on the rank's GPU. Create it with device=distlab.device() "
                        "(or the device of the parameters it serves).")
        if name in _FACTORIES:
            out = func(*args, **kwargs)
            device = kwargs.get("device")
            host = name in ("from_numpy", "frombuffer") or _is_host_device(device)
            for t in _tensors(out):
                self.book.mark(t, HOST if host else PLACED, _where() if host else None)
            return out
        tensors = _tensors(args)
        if kwargs:
            _tensors(kwargs, tensors)
        out = func(*args, **kwargs)
        if name in ("to", "cuda", "cpu", "_to_copy"):
            target = HOST if name == "cpu" else _to_target(args, kwargs)
            if target is not None:
                for t in _tensors(out):
                    self.book.mark(t, target, _where() if target == HOST else None)
                return out
        placed, host, big_host = False, None, None
        for t in tensors:
            kind = _place(t)
            if kind == PLACED:
                placed = True
            elif kind == HOST:
                host = host if host is not None else t
                if big_host is None and t.numel() > 1:
                    big_host = t
        if placed and big_host is not None and name not in _MIXING_ALLOWED:
            raise DeviceAuditError(
                f"device audit: {name}() mixes a tensor on the rank's device with a {_describe(big_host)} "
                f"created without a device at {self.book.born(big_host)}. On a GPU this raises "
                "'Expected all tensors to be on the same device'. Create it with device=distlab.device() "
                "(or device=<a parameter>.device), or move it with .to(distlab.device()).")
        if placed or host is not None:
            result, born = (PLACED, None) if placed else (HOST, self.book.born(host))
            for t in _tensors(out):
                if _place(t) is None:
                    self.book.mark(t, result, born)
        return out


def _namespace(op: Any) -> str:
    """'c10d' for torch.ops.c10d.<op> (an OpOverload or its packet)."""
    qualified = getattr(op, "_qualified_op_name", None) or getattr(op, "name", lambda: "")()
    return qualified.split("::")[0] if isinstance(qualified, str) else ""


def _to_target(args: tuple, kwargs: dict) -> str | None:
    """HOST / PLACED for a `.to(...)` that names a device (or a tensor); None for a dtype-only `.to`."""
    device = kwargs.get("device", None)
    for a in list(args[1:]):
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    if device is None:
        return None
    return HOST if _is_host_device(device) else PLACED


def _refuse_meshless_fully_shard(*args: Any, **kwargs: Any) -> Any:
    raise DeviceAuditError(
        "device audit: fully_shard() was called without mesh=. It then builds its mesh on this machine's "
        "accelerator type, not on the rank's device (gloo ranks on a GPU box would all land on cuda:0). "
        "Pass mesh=distlab.mesh().")


class DeviceAudit:
    """Context manager: audit device placement on this (CPU) rank. See the module docstring."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def mark_host(self, tree: Any, born: str) -> None:
        """Class every tensor in `tree` (lists, tuples, dicts) as a host tensor born at `born`."""
        for t in _tensors(tree):
            self.book.mark(t, HOST, born)

    def __enter__(self) -> "DeviceAudit":
        self.book = _Book()
        self._mode = _FunctionAudit(self.book, strict=self.strict)
        self._mode.__enter__()
        self._patched = []
        # torch turns a function mode off while it handles a call, and backward() is such a call: the backward
        # hooks (DDP's and ZeRO-2's bucket all-reduces, FSDP's reduce-scatter, a lab's grad hooks) would run
        # unseen. backward() and autograd.grad() reach the engine through this name after their own
        # mode handling: the engine runs with the audit on again.
        # (torch.compiler patches the same two names the same way for its tracing.)
        import torch.autograd as autograd
        import torch.autograd.graph as graph
        engine = getattr(autograd, "_engine_run_backward", None)
        if engine is not None and getattr(graph, "_engine_run_backward", None) is engine:
            mode = self._mode

            def audited_backward(*args: Any, **kwargs: Any) -> Any:
                with mode:
                    return engine(*args, **kwargs)
            for module in (autograd, graph):
                self._patched.append((module, "_engine_run_backward", engine))
                module._engine_run_backward = audited_backward
        # fully_shard looks its default mesh up by these names at call time.
        for module_name in ("torch.distributed.fsdp._fully_shard._fully_shard",
                            "torch.distributed.fsdp._fully_shard._fsdp_init"):
            try:
                module = importlib.import_module(module_name)
            except ImportError:   # another torch layout: nothing to refuse
                continue
            for attr in ("_init_default_mesh", "_init_default_fully_shard_mesh"):
                if hasattr(module, attr):
                    self._patched.append((module, attr, getattr(module, attr)))
                    setattr(module, attr, _refuse_meshless_fully_shard)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, attr, original in self._patched:
            setattr(module, attr, original)
        self._mode.__exit__(*exc)


# ---- static checks of notebook code ---------------------------------------------------------------

def lint_source(source: str) -> list[str]:
    """Problems a GPU would expose in one cell's code: bare timers (no device sync)."""
    problems = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return problems
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            text = ast.unparse(node.func)
            if text in ("time.perf_counter", "perf_counter", "time.perf_counter_ns", "time.time",
                        "time.monotonic", "monotonic"):
                problems.append(f"line {node.lineno}: {text}() times without waiting for the device "
                                "(on a GPU it measures kernel launches): use distlab.meters.time_call, "
                                "PhaseTimer or distlab.bench.race")
    return problems


def lint_notebook(path: str | os.PathLike) -> list[str]:
    """`lint_source` over every code cell of a notebook: ['cell K line L: ...']."""
    import nbformat
    nb = nbformat.read(str(path), as_version=4)
    out = []
    for k, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            out += [f"cell {k} {p}" for p in lint_source(cell.source)]
    return out
