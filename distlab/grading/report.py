"""Reports of a class run, for an instructor and for an LMS.

- `grades.csv`: one row per student (the notebook's name), one column per task (its points), the total and the
  most; the form an LMS gradebook imports.
- `grades.html`: the gradebook at a glance: students x tasks, points coloured by PASS/FAIL, each cell opening
  on its verdict lines with their whole reasons and whether each is enforced or detected, the Audit column, the
  time each submission took.
- `grades.md` (the same table in text, every failure below it), `lines.csv` (one row per verdict line and a
  TOTAL row per student) and `junit.xml` (one test case per verdict line).

A verdict line is *enforced* when nothing a submission does can change it short of computing the right thing
(values judged here, on inputs drawn from a secret seed; on CPU the traffic its ranks' brokers booked);
*detected* when it rests on what the audit hook saw inside a rank (memory, an API the lab forbids; traffic on
NCCL), see `grade.how`. Any evidence of tampering zeroes its task and is listed in the Audit column.
"""
from __future__ import annotations

import csv
import html
import xml.etree.ElementTree as ET
from pathlib import Path


def _fmt(x: float) -> str:
    return f"{x:g}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _audit(flags: list[str], limit: int = 160) -> str:
    text = "; ".join(flags[:2]) + (f"; and {len(flags) - 2} more" if len(flags) > 2 else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def student(r) -> str:
    """A submission's student: its file name without the folder and the .ipynb."""
    return Path(r.submission).stem


def tasks_of(results) -> list[str]:
    """Every task graded, in the order the lab grades them."""
    return list(dict.fromkeys(v.task or v.check for r in results for v in r.verdicts))


def by_task(r) -> dict[str, tuple[float, float]]:
    """Task -> (points, most) of one submission."""
    out: dict[str, list[float]] = {}
    for v in r.verdicts:
        got = out.setdefault(v.task or v.check, [0.0, 0.0])
        got[0] += v.points
        got[1] += v.max_points
    return {t: (p, m) for t, (p, m) in out.items()}


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
    """One row per student: student, each task's points, total, max, note (an LMS imports it as it is)."""
    tasks = tasks_of(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", *tasks, "total", "max", "note"])
        for r in results:
            points = by_task(r)
            w.writerow([student(r), *(_fmt(points[t][0]) if t in points else "" for t in tasks), _fmt(r.score),
                        _fmt(r.max_score), r.note])


def write_lines_csv(results, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "check", "points", "max_points", "status", "reason", "how"])
        for r in results:
            for v in r.verdicts:
                w.writerow([r.submission, v.check, _fmt(v.points), _fmt(v.max_points),
                            "pass" if not v.reason else "fail", v.reason, v.how])
            w.writerow([r.submission, "TOTAL", _fmt(r.score), _fmt(r.max_score), "", r.note, ""])


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


STYLE = ("body{font-family:system-ui,sans-serif;max-width:80rem;margin:2rem auto;padding:0 1rem;line-height:1.45;"
         "color:#222}table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}th,td{border:1px solid #ccc;"
         "padding:.25rem .5rem;vertical-align:top;text-align:right}th{background:#f3f3f3}td:first-child,"
         "th:first-child{text-align:left}td.pass{background:#dff0d8}td.fail{background:#f8d7da}td.part{background:"
         "#fff3cd}td.audit{text-align:left;color:#8a1f11;font-size:.8rem}details ul{text-align:left;margin:.3rem 0;"
         "padding-left:1rem;max-width:40rem;white-space:normal}li.fail{color:#8a1f11}.how{color:#666;"
         "font-size:.75rem}summary{cursor:pointer}")


def _task_cell(r, task: str) -> str:
    lines = [v for v in r.verdicts if (v.task or v.check) == task]
    if not lines:
        return "<td></td>"
    points, most = sum(v.points for v in lines), sum(v.max_points for v in lines)
    kind = "pass" if points == most else "fail" if points == 0 else "part"
    items = "".join(
        f"<li class='{'fail' if v.reason else 'pass'}'>{'FAIL' if v.reason else 'PASS'} {html.escape(v.check)}"
        + (f": {html.escape(v.reason)}" if v.reason else "") + f" <span class='how'>[{v.how}]</span></li>"
        for v in lines)
    return (f"<td class='{kind}'><details><summary>{_fmt(points)}/{_fmt(most)}</summary><ul>{items}</ul>"
            "</details></td>")


def gradebook(results, lab: str = "") -> str:
    """The HTML gradebook (see the module docstring)."""
    tasks = tasks_of(results)
    head = "".join(f"<th>{html.escape(t)}</th>" for t in ["Student", *tasks, "Total", "Time", "Audit / note"])
    rows = []
    for r in results:
        total = "pass" if r.max_score and r.score == r.max_score else "fail" if r.score == 0 else "part"
        flags = "".join(f"<li>{html.escape(f)}</li>" for f in r.flags)
        side = (f"<ul>{flags}</ul>" if flags else "") + html.escape(r.note)
        rows.append(f"<tr><td>{html.escape(student(r))}</td>" + "".join(_task_cell(r, t) for t in tasks)
                    + f"<td class='{total}'><b>{_fmt(r.score)}/{_fmt(r.max_score)}</b></td>"
                    + f"<td>{r.seconds:.0f} s</td><td class='audit'>{side}</td></tr>")
    legend = ("Click a score to see its verdict lines. <b>enforced</b>: judged here from the ranks' values on "
              "inputs drawn from a secret seed, and on CPU the traffic their brokers booked; <b>detected</b>: rests "
              "on what the audit hook saw inside a rank (memory, an API the lab forbids, traffic on NCCL) or was "
              "zeroed by such evidence: read those notebooks.")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Grades for {html.escape(lab)}</title>"
            f"<style>{STYLE}</style></head><body><h1>Grades for {html.escape(lab)}</h1><p>{len(results)} "
            f"submissions. {legend}</p><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            "</body></html>\n")


def write_reports(results, out: Path, lab: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "grades.csv")
    write_lines_csv(results, out / "lines.csv")
    (out / "grades.html").write_text(gradebook(results, lab))
    details = [f"# Grades for {lab}", "", markdown(results), ""]
    for r in results:
        failed = [v for v in r.verdicts if v.reason]
        if failed or r.flags:
            details += [f"## {r.submission}: {_fmt(r.score)}/{_fmt(r.max_score)}", ""]
            details += [f"- {v.check} [{v.how}]: {v.reason}" for v in failed]
            details += [f"- audit: {f}" for f in r.flags] + [""]
    (out / "grades.md").write_text("\n".join(details) + "\n")
    write_junit(results, out / "junit.xml", lab)
