"""Teach a class over several cells: each cell adds one method (as d2l's `add_to_class`).

    class ZeRO3(torch.nn.Module):
        def __init__(self, module): ...

    @add_to_class(ZeRO3)
    def _gather(self, unit):          # a later cell, with its own graded check
        ...

The method is set on the class itself, so objects made before the cell ran
get it too.
"""
from __future__ import annotations

from typing import Any, Callable


def add_to_class(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `@add_to_class(C)` on a function makes it the method `C.<name>`."""
    if not isinstance(cls, type):
        raise TypeError(f"add_to_class needs a class, got {type(cls).__name__}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(cls, fn.__name__, fn)
        return fn

    return decorate
