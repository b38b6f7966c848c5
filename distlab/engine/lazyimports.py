"""Third-party imports deferred until they are used.

`import nbformat` imports jsonschema, which imports `rfc3987_syntax` (installed with
jupyterlab, for jsonschema's "iri" formats) when it is there. That module builds ~40
Lark parsers from its grammar as it is imported: ~2-3.5 s of CPU on a laptop core,
in every process that reads a notebook (pytest and its workers, `distlab tour`,
`distlab grade`), while no notebook schema uses an "iri" format.

`defer_rfc3987_syntax()` puts a stand-in in its place until something calls it:
jsonschema registers its "iri" checks as before, and the first check to run imports
the real module and calls it. Nothing changes but when the cost is paid.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


class _Deferred(types.ModuleType):
    """Stands in for a module until it is used. An attribute named with one of `functions`' prefixes
    is a function that loads the module when called (what `from module import function` binds);
    any other attribute loads it at once."""

    def __init__(self, name: str, functions: tuple[str, ...]) -> None:
        super().__init__(name)
        self._real: types.ModuleType | None = None
        self._functions = functions

    def _load(self) -> types.ModuleType:
        if self._real is None:
            sys.modules.pop(self.__name__, None)       # the real import, as if nothing had stood in
            try:
                self._real = importlib.import_module(self.__name__)
            except BaseException:
                sys.modules[self.__name__] = self
                raise
        return self._real

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr.startswith(self._functions):
            def call(*args: Any, **kwargs: Any) -> Any:
                return getattr(self._load(), attr)(*args, **kwargs)
            call.__name__ = call.__qualname__ = attr
            return call
        return getattr(self._load(), attr)


def defer(name: str, functions: tuple[str, ...], importers: tuple[str, ...] = ()) -> bool:
    """Stand in for module `name` if it is installed and neither it nor any of `importers` (modules
    that bind its functions when imported) is imported yet; True if the stand-in is in place."""
    if name in sys.modules or any(m in sys.modules for m in importers):
        return isinstance(sys.modules.get(name), _Deferred)
    if importlib.util.find_spec(name) is None:
        return False
    sys.modules[name] = _Deferred(name, functions)
    return True


def defer_rfc3987_syntax() -> bool:
    """jsonschema binds `is_valid_syntax` from it as it is imported (hence: before jsonschema)."""
    return defer("rfc3987_syntax", ("is_valid_syntax",), importers=("jsonschema",))
