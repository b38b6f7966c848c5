"""Reports of a class run: grades.csv (one row per verdict line), grades.md, junit.xml.

The Audit column lists what the audit hooks saw learner code do (see
`distlab.grading.evidence`); a task with any such evidence scores zero.
"""
from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from pathlib import Path


def _fmt(x: float) -> str:
    return f"{x:g}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _audit(flags: list[str], limit: int = 160) -> str:
    text = "; ".join(flags[:2]) + (f"; and {len(flags) - 2} more" if len(flags) > 2 else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
                    f"{_cell(note)} | {_cell(_audit(r.flags))} |")
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
