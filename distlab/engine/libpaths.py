"""Where library code lives: the roots that tell a learner's frames from Python's, the installed packages'
and distlab's own (the launcher naming the line a rank waits at, the grader's audit hook)."""
from __future__ import annotations

import os


def library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(library roots: stdlib, site-packages, the distlab package; stdlib roots only), links resolved,
    each ending in the path separator."""
    import site
    import sysconfig
    paths = sysconfig.get_paths()
    stdlib = os.path.realpath(paths["stdlib"]) + os.sep
    pkg = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir)) + os.sep
    sites = {os.path.realpath(p) + os.sep for p in (paths["purelib"], paths["platlib"], *site.getsitepackages())}
    return tuple(sorted({stdlib, pkg, *sites})), (stdlib,)
