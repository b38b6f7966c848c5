"""The package's layers, read from its imports: none runs upward, none makes a circle.

    engine  <  theory  <  meters  <  bench  <  course  <  checks  <  grading  <  apps
                                   viz (engine, theory, meters)           apps: the commands

Every `import` and `from ... import` in distlab's source counts, module-level or inside a function
(a lazy import is still a dependency). The top-level `distlab` (the learner's facade: launch, device,
pick, ...) re-exports the engine, `meters.records` and `course.stepwise`; only checks, grading and apps
may import it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "distlab"

# Which layers each layer may import (itself included). The folders' __init__ docstrings say the same.
ALLOWED = {
    "engine": {"engine"},
    "theory": {"engine", "theory"},
    "meters": {"engine", "theory", "meters"},
    "bench": {"engine", "theory", "meters", "bench"},
    "course": {"engine", "theory", "meters", "bench", "course"},
    "viz": {"engine", "theory", "meters", "viz"},
    "checks": {"engine", "theory", "meters", "bench", "course", "checks", "facade"},
    "grading": {"engine", "theory", "meters", "bench", "course", "checks", "grading", "facade"},
    "apps": {"engine", "theory", "meters", "bench", "course", "checks", "grading", "viz", "apps", "facade"},
    "facade": {"engine", "meters", "course"},
}


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, pkg: Path = PKG) -> bool:
    rel = Path(*name.split("."))
    return (pkg.parent / rel).with_suffix(".py").exists() or (pkg.parent / rel / "__init__.py").exists()


def layer(name: str) -> str:
    parts = name.split(".")
    return "facade" if len(parts) == 1 else parts[1]


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """The distlab modules `path` imports, resolved: `from distlab.meters import records` is distlab.meters.records."""
    me = module_name(path, pkg)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "distlab"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "distlab":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if is_module(sub, pkg) else base)
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def test_every_module_is_in_a_layer():
    # Nothing flat at the top any more but the facade: a module has a folder, and the folder says what it is.
    stray = [m for m in graph() if m != "distlab" and layer(m) not in ALLOWED]
    assert not stray, f"modules outside the layers {sorted(ALLOWED)}: {stray}"


def test_no_import_runs_upward():
    wrong = [f"{m} imports {d} ({layer(m)} may import {sorted(ALLOWED[layer(m)])})"
             for m, deps in graph().items() for d in sorted(deps) if layer(d) not in ALLOWED[layer(m)]]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_commands():
    users = [(m, d) for m, deps in graph().items() for d in deps if layer(d) == "apps" and layer(m) != "apps"]
    assert not users, users


def test_no_circles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:              # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other (directly or around a circle): {circles}"


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PKG.glob("*/__init__.py")))
def test_each_folder_says_what_it_may_import(folder):
    doc = ast.get_docstring(ast.parse((PKG / folder / "__init__.py").read_text())) or ""
    line = next((ln for ln in doc.splitlines() if ln.startswith("May import:")), None)
    assert line is not None, f"distlab/{folder}/__init__.py: its docstring needs a 'May import:' line"
    named = {w.strip(" ,.;()`") for w in line[len("May import:"):].split()}
    allowed = ALLOWED[folder] - {folder, "facade"}
    if folder == "apps":
        assert "everything" in named
    elif not allowed:
        assert "nothing" in named, line
    else:
        missing = allowed - named
        assert not missing, f"distlab/{folder}: the docstring's 'May import:' leaves out {sorted(missing)}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a lazy import of a course module in the engine is caught (so the tests above can fail)."""
    fake = tmp_path / "distlab"
    (fake / "engine").mkdir(parents=True)
    (fake / "course").mkdir()
    for d in (fake, fake / "engine", fake / "course"):
        (d / "__init__.py").write_text('"""x"""\n')
    (fake / "course" / "models.py").write_text("import torch\n")
    (fake / "engine" / "launch.py").write_text("def f():\n    from distlab.course import models\n    from . import runtime\n")
    (fake / "engine" / "runtime.py").write_text("")
    deps = imports_of(fake / "engine" / "launch.py", fake)
    assert deps == {"distlab.course.models", "distlab.engine.runtime"}
    assert layer("distlab.course.models") not in ALLOWED["engine"]
