"""Reports of `distlab grade`: CSV, Markdown, JUnit XML, and an audit of suspicious answers."""
from __future__ import annotations

import ast
import csv
import xml.etree.ElementTree as ET
from pathlib import Path

# Constructs an honest answer to these labs never needs. Learner code runs on
# the ranks, where it could tamper with the rank-side half of a check; the
# audit lists such code for the instructor to read. It changes no score.
_SUSPICIOUS_CALLS = {"setattr", "delattr", "globals", "exec", "eval", "compile", "__import__", "vars"}
_SUSPICIOUS_ATTRS = {"_getframe", "f_globals", "f_locals", "f_back", "modules", "_exit", "get_objects",
                     "__builtins__", "__dict__", "__kwdefaults__", "__defaults__", "__code__", "kill", "fork"}
_SUSPICIOUS_MODULES = {"builtins", "ctypes", "inspect", "gc", "signal", "subprocess", "distlab.checks",
                       "distlab.launch", "distlab.meters", "importlib", "socket", "zmq",
                       "jupyter_client", "multiprocessing", "threading"}
_PATCHABLE = {"dist", "torch", "distlab", "checks", "os", "sys", "builtins", "F", "nn"}


def audit(source: str) -> list[str]:
    """Short notes on code that could tamper with a check (deduplicated, in order)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"syntax error line {exc.lineno}"]
    notes: list[str] = []
    modules = set(_PATCHABLE)   # names bound to imported modules: assigning their attributes patches them
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SUSPICIOUS_CALLS:
            notes.append(f"calls {node.func.id}() line {node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in _SUSPICIOUS_ATTRS:
            notes.append(f"uses .{node.attr} line {node.lineno}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            notes += [f"imports {m} line {node.lineno}" for m in mods if m in _SUSPICIOUS_MODULES]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if t is not base and isinstance(base, ast.Name) and base.id in modules:
                    notes.append(f"assigns to {ast.unparse(t)} line {node.lineno}")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            notes.append(f"declares {type(node).__name__.lower()} {', '.join(node.names)} line {node.lineno}")
        elif isinstance(node, ast.Name) and node.id in ("print", "check", "compare", "expect") \
                and isinstance(node.ctx, ast.Store):
            notes.append(f"rebinds {node.id} line {node.lineno}")
        elif isinstance(node, ast.FunctionDef) and node.name in ("__reduce__", "__reduce_ex__", "__setstate__"):
            notes.append(f"defines {node.name} (runs when unpickled) line {node.lineno}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ("print", "check", "compare"):
            notes.append(f"defines {node.name} line {node.lineno}")
    return list(dict.fromkeys(notes))


def _fmt(x: float) -> str:
    return f"{x:g}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(results, detail: bool = False) -> str:
    """A table: one row per submission (score, first failure); with `detail`, one row per check."""
    if detail:
        rows = ["| Check | Points | Result |", "|---|---|---|"]
        for r in results:
            for v in r.verdicts:
                rows.append(f"| {v.check} | {_fmt(v.points)}/{_fmt(v.max_points)} | "
                            f"{'PASS' if not v.reason else 'FAIL: ' + _cell(v.reason)} |")
            rows.append(f"| **total** | **{_fmt(r.score)}/{_fmt(r.max_score)}** | {r.note} |")
        return "\n".join(rows)
    rows = ["| Submission | Score | Max | Passed | Note / first failure | Audit |", "|---|---|---|---|---|---|"]
    for r in results:
        passed = sum(1 for v in r.verdicts if not v.reason)
        first = next((f"{v.check}: {v.reason}" for v in r.verdicts if v.reason), "")
        note = r.note or first
        if len(note) > 120:
            note = note[:117] + "..."
        rows.append(f"| {r.submission} | {_fmt(r.score)} | {_fmt(r.max_score)} | {passed}/{len(r.verdicts)} | "
                    f"{_cell(note)} | {_cell('; '.join(r.flags[:3]))} |")
    return "\n".join(rows)


def write_csv(results, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "check", "points", "max_points", "status", "reason"])
        for r in results:
            for v in r.verdicts:
                w.writerow([r.submission, v.check, _fmt(v.points), _fmt(v.max_points),
                            "pass" if not v.reason else "fail", v.reason])
            w.writerow([r.submission, "TOTAL", _fmt(r.score), _fmt(r.max_score), "", r.note])


def write_junit(results, path: Path, lab: str = "") -> None:
    suites = ET.Element("testsuites", name=f"distlab grade {lab}")
    for r in results:
        fails = sum(1 for v in r.verdicts if v.reason)
        suite = ET.SubElement(suites, "testsuite", name=r.submission, tests=str(len(r.verdicts)),
                              failures=str(fails), errors="0", time=f"{r.seconds:.1f}")
        if r.flags:
            props = ET.SubElement(suite, "properties")
            ET.SubElement(props, "property", name="audit", value="; ".join(r.flags))
        for v in r.verdicts:
            case = ET.SubElement(suite, "testcase", classname=r.submission, name=v.check)
            if v.reason:
                ET.SubElement(case, "failure", message=v.reason).text = f"0/{_fmt(v.max_points)} points"
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def write_reports(results, out: Path, lab: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "grades.csv")
    details = [f"# Grades for {lab}", "", markdown(results), ""]
    for r in results:
        failed = [v for v in r.verdicts if v.reason]
        if failed or r.flags:
            details += [f"## {r.submission}: {_fmt(r.score)}/{_fmt(r.max_score)}", ""]
            details += [f"- {v.check}: {v.reason}" for v in failed]
            details += [f"- audit: {f}" for f in r.flags] + [""]
    (out / "grades.md").write_text("\n".join(details) + "\n")
    write_junit(results, out / "junit.xml", lab)
