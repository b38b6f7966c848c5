"""Teach a class over several cells: each cell adds one method (as d2l's `add_to_class`).

    class ZeRO3(torch.nn.Module):
        def __init__(self, module): ...

    @add_to_class(ZeRO3)
    def _gather(self, unit):          # a later cell, with its own graded check
        ...

The method is set on the class itself, so objects made before the cell ran
get it too.

Re-running the class's own cell makes a new class without the methods later
cells added. In a notebook the new class gets them back at the end of that
cell, with a note saying so (the class body wins where it defines a method
itself); elsewhere `missing_methods` says which are gone, and a graded
check explains it (`redefined_message`) instead of reporting an
AttributeError for code that exists.
"""
from __future__ import annotations

from typing import Any, Callable

# (module, qualname) of a class -> the methods `add_to_class` gave it, in the order the cells ran.
_ADDED: dict[tuple[str, str], dict[str, Callable[..., Any]]] = {}
_HOOKED: set[int] = set()


def _key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def add_to_class(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `@add_to_class(C)` on a function makes it the method `C.<name>`."""
    if not isinstance(cls, type):
        raise TypeError(f"add_to_class needs a class, got {type(cls).__name__}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(cls, fn.__name__, fn)
        added = _ADDED.setdefault(_key(cls), {})
        added.pop(fn.__name__, None)      # re-added: it moves to the end, as the latest cell
        added[fn.__name__] = fn
        _keep_across_redefinitions()
        return fn

    return decorate


def missing_methods(cls: type) -> list[str]:
    """The methods `add_to_class` gave an earlier class of this name that `cls` lacks (it was redefined
    after those cells ran), in the order they were added."""
    if not isinstance(cls, type):
        return []
    return [name for name in _ADDED.get(_key(cls), {}) if not hasattr(cls, name)]


def restore(cls: type) -> list[str]:
    """Give `cls` back the added methods it lacks (`missing_methods`); returns their names."""
    names = missing_methods(cls)
    for name in names:
        setattr(cls, name, _ADDED[_key(cls)][name])
    return names


def redefined_message(cls: type) -> str:
    """What to tell a learner whose class lost methods by a redefinition; "" when none is missing."""
    names = missing_methods(cls)
    if not names:
        return ""
    return (f"the class {cls.__name__} was redefined after the cells that add {', '.join(names)} ran, so it "
            f"lacks them: re-run the cells that define {', '.join(names)} (in order), then this check")


def _keep_across_redefinitions() -> None:
    """In IPython: after each cell, a class that lost its added methods by a redefinition gets them back."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or id(shell) in _HOOKED:
        return
    _HOOKED.add(id(shell))

    def after_cell(*_: Any) -> None:
        for name, obj in list(shell.user_ns.items()):
            if isinstance(obj, type) and not name.startswith("_") and _key(obj) in _ADDED:
                kept = restore(obj)
                if kept:
                    print(f"distlab: {obj.__name__} was redefined; it keeps the methods later cells added "
                          f"({', '.join(kept)}). Re-run a method's cell to change it.")

    shell.events.register("post_run_cell", after_cell)
