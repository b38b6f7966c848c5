"""Learner answers that exist only on the ranks (used by `distlab grade`).

In a graded notebook the learner's answer cells are never executed in the
kernel that runs the check cells. Each name an answer cell of the shipped lab
defines (`ring_all_reduce`, `NaiveDDP`, ...) is bound in the kernel to a
`RemoteAnswer`: an inert handle the check code can pass around, compare with
`is`, use as a dict key and read `__name__` from. When a check launches ranks,
the handle travels by pickle and is rebuilt on each rank by executing the
learner's answer cells there, in a fresh namespace; the rank then calls the
real function or class. So nothing the learner wrote can touch the kernel that
prints the verdicts: not `check`, not `print`, not `compare`, not the check
cells' helpers. On the rank, module attributes the learner rebinds (torch,
torch.distributed, distlab, builtins) are put back after the answer cells run
and each time a learner's function returns, so a check's own reference
computation there is not fooled by `dist.all_reduce = ...`. Deeper tampering on
a rank (editing objects in place) is not prevented; the audit flags it.
"""
from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import io
import pickle
import sys
import types
from typing import Any

import cloudpickle

_NAMESPACES: dict[str, dict] = {}   # per process: digest of the answers -> executed namespace
_SNAPSHOTS: dict[str, dict] = {}    # ... -> module attributes before the answers ran


class GradingError(RuntimeError):
    """The learner's answer cannot provide a name the checks need."""


def _referenced_names(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


class Answers:
    """The learner's answer cells (source text per shipped cell id), executed only on ranks."""

    def __init__(self, cells: list[tuple[str, str]], names: list[str]):
        self.cells = cells          # [(shipped cell id, learner source)] in the shipped order
        self.names = list(names)    # the names the checks use
        self.digest = hashlib.sha256(repr(cells).encode()).hexdigest()


_GUARDED = ("builtins", "torch", "torch.distributed", "torch.distributed.distributed_c10d")
_MISSING = object()


def _snapshot() -> dict:
    """The attributes of the modules a check relies on, before any learner code runs on this rank."""
    names = list(_GUARDED) + [m for m in sys.modules if m.startswith("distlab.") and "grading" not in m]
    return {m: dict(vars(sys.modules[m])) for m in names if m in sys.modules}


def _restore(snapshot: dict) -> None:
    """Undo what learner code rebound in those modules (e.g. `dist.all_reduce = ...`)."""
    for m, saved in snapshot.items():
        current = vars(sys.modules[m])
        for key, value in saved.items():
            if current.get(key, _MISSING) is not value:
                current[key] = value


def _guard(fn: Any, snapshot: dict) -> Any:
    """A learner's function whose module patches are undone each time it returns to the check."""
    if not isinstance(fn, types.FunctionType):
        return fn

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            _restore(snapshot)
    return guarded


def _materialize(answers: Answers, env: dict, name: str) -> Any:
    """On a rank: execute the answers once per process and return the learner's `name`."""
    ns = _NAMESPACES.get(answers.digest)
    if ns is None:
        snapshot = _snapshot()
        _SNAPSHOTS[answers.digest] = snapshot
        ns = {"__name__": "__main__", "__builtins__": builtins}
        ns.update(env)
        errors = {}
        for cell_id, src in answers.cells:
            try:
                exec(compile(src, f"<answer cell {cell_id}>", "exec"), ns)  # noqa: S102 - the learner's answer, on a rank
            except Exception as exc:  # noqa: BLE001 - reported when a name is missing
                errors[cell_id] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _restore(snapshot)
        ns["__distlab_answer_errors__"] = errors
        _NAMESPACES[answers.digest] = ns
    if name in ns:
        return _guard(ns[name], _SNAPSHOTS[answers.digest])
    errors = ns.get("__distlab_answer_errors__", {})
    why = f" (your answer cell raised {'; '.join(errors.values())})" if errors else ""
    raise GradingError(f"your notebook does not define {name}{why}")


class RemoteAnswer:
    """Kernel-side handle for one learner name; becomes the real object on a rank."""

    def __init__(self, answers: Answers, name: str, kernel_globals: dict):
        self._answers, self.__name__, self.__qualname__ = answers, name, name
        self._globals = kernel_globals

    def _env(self) -> dict:
        """What the learner's code may use from the notebook's setup cells (picklable only)."""
        wanted = set()
        for _, src in self._answers.cells:
            wanted |= _referenced_names(src)
        env = {}
        for key in sorted(wanted - set(self._answers.names)):
            if key in self._globals and not key.startswith("__"):
                value = self._globals[key]
                try:
                    cloudpickle.dumps(value)
                except Exception:  # noqa: BLE001 - a figure, a lock...: the answer cannot use it
                    continue
                env[key] = value
        return env

    def __reduce__(self):
        return _materialize, (self._answers, self._env(), self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise GradingError(f"{self.__name__}: while grading, answers run on the ranks only")

    def __repr__(self) -> str:
        return f"<learner's {self.__name__}, run on ranks only>"


_ALLOWED = {("builtins", n) for n in ("list", "dict", "set", "frozenset", "tuple", "int", "float", "complex",
                                      "str", "bytes", "bytearray", "bool", "slice", "range")}
_ALLOWED |= {("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")}
_ALLOWED |= {("copyreg", "_reconstructor"), ("torch", "Size"), ("torch", "device")}


def _load_storage(b: bytes) -> Any:
    """torch.storage._load_from_bytes without its weights_only=False (which would run any pickle)."""
    import io

    import torch
    return torch.load(io.BytesIO(b), weights_only=True)


class _RankResultUnpickler(pickle.Unpickler):
    """Unpickles what ranks send back, refusing anything that could run code in the kernel.

    Allowed: plain containers and numbers, torch tensors/dtypes/devices/sizes
    (storages loaded weights_only), and classes (never functions) from torch,
    collections and distlab's meters/models. A learner's own class, a function or a
    `__reduce__` trick is refused: the check fails instead of the kernel running it.
    """

    def find_class(self, module: str, name: str) -> Any:
        top = module.split(".")[0]
        if "." in name:
            pass   # a dotted name can reach anything re-exported by an allowed module
        elif module == "torch.storage" and name == "_load_from_bytes":
            return _load_storage
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        elif top in ("torch", "distlab", "numpy") and not module.startswith("distlab.grading"):
            obj = super().find_class(module, name)
            home = (getattr(obj, "__module__", "") or "").split(".")[0]
            import dataclasses

            import torch
            if top == "torch" and (name.startswith("_rebuild") and home == "torch"
                                   or isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format))
                                   or isinstance(obj, type) and issubclass(obj, (torch.Tensor, torch.Size))):
                return obj
            if top == "distlab" and home == "distlab" and isinstance(obj, type) \
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, tuple)):
                return obj
            if top == "numpy" and name in ("_reconstruct", "scalar", "dtype", "ndarray") and home == "numpy":
                return obj
        raise pickle.UnpicklingError(
            f"the ranks returned a {module}.{name}, which the grader does not unpickle "
            "(only tensors, numbers, strings, containers and distlab/torch classes)")


def safe_loads(data: bytes) -> Any:
    return _RankResultUnpickler(io.BytesIO(data)).load()


def install(cells: list[tuple[str, str]], names: list[str], kernel_globals: dict) -> None:
    """Kernel side: bind each answer name to a RemoteAnswer; unpickle rank results safely."""
    answers = Answers(cells, names)
    for name in names:
        kernel_globals[name] = RemoteAnswer(answers, name, kernel_globals)
    import sys
    import types

    import distlab.launch  # noqa: F401 - the module, whose `launch` the package re-exports
    launch_mod = sys.modules["distlab.launch"]
    # Results and errors come back from ranks, where learner code ran: never unpickle code from them.
    launch_mod.cloudpickle = types.SimpleNamespace(dumps=cloudpickle.dumps, loads=safe_loads)



def cap_launch_timeout(seconds: float) -> None:
    """Kernel side, before any setup cell: every launch ends within `seconds`, whatever it asks for."""
    import functools
    import sys

    import distlab
    import distlab.launch  # noqa: F401 - the module, whose `launch` the package re-exports
    launch_mod = sys.modules["distlab.launch"]
    original = launch_mod.launch

    @functools.wraps(original)
    def launch(fn, world_size, *args, timeout=seconds, **kwargs):
        return original(fn, world_size, *args, timeout=min(float(timeout), seconds), **kwargs)

    launch_mod.launch = distlab.launch = launch


def defined_names(source: str) -> list[str]:
    """Top-level functions and classes a (shipped) answer cell defines."""
    tree = ast.parse(source)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
