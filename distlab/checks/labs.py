"""Generate `labs/` from `solutions/`: answers out, graded checks kept.

In a solution notebook every answer sits between fence lines:

    def ring_all_reduce(tensor):
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

The lab keeps the `def` line and replaces the fenced block with
`raise NotImplementedError(...)` at the same indentation. Every output is
cleared, so a learner opens a lab that shows no verdict. The solution's
output of each graded check cell (tag `nbval-check-output`: its verdict
table and lines) is kept in the cell's metadata (`metadata.distlab.expected`), where the grader and
nbval (through distlab's pytest plugin, `distlab.apps.nbval_plugin`) read them.

A maintainer's command, never a learner's: it refuses to overwrite a lab
that was edited since it was generated (a learner's work), unless forced.

    distlab build-labs            # regenerate labs/ from solutions/
    distlab build-labs --check    # exit 1 if labs/ is out of date
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG = "nbval-check-output"
ANSWER_TAG = "answer"
_STUB = 'raise NotImplementedError("your code here")'


def strip_answers(source: str) -> str:
    """Replace every fenced answer in `source` by a NotImplementedError stub."""
    out, inside, indent = [], False, ""
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{_STUB}")
            continue
        if stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out)


def is_check_cell(cell: nbformat.NotebookNode) -> bool:
    return CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def verdict_lines(cell: nbformat.NotebookNode) -> list[str]:
    """The PASS/FAIL lines a check cell printed (its stdout), in order."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [line for line in text.splitlines() if line.startswith(("PASS ", "FAIL "))]


def output_lines(cell: nbformat.NotebookNode) -> list[str]:
    """Everything a check cell printed on stdout, line by line: the verdict table and the verdict lines."""
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [line for line in text.splitlines() if line.strip()]


def expected_lines(cell: nbformat.NotebookNode) -> list[str]:
    """What a lab's check cell should print (the solution's verdict table and lines), kept in its metadata;
    its verdict lines are those that start with PASS or FAIL."""
    return list(cell.get("metadata", {}).get("distlab", {}).get("expected", []))


def make_lab(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The learner's version of an (executed) solution notebook: answers stubbed, no outputs."""
    lab = copy.deepcopy(solution)
    for cell in lab.cells:
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            cell.source = strip_answers(cell.source)
            tags = cell.metadata.setdefault("tags", [])
            if ANSWER_TAG not in tags:
                tags.append(ANSWER_TAG)
        if is_check_cell(cell):
            cell.metadata.setdefault("distlab", {})["expected"] = output_lines(cell)
        cell.outputs = []
        cell.execution_count = None
    lab.metadata.setdefault("distlab", {})["generated"] = _digest(lab)
    return lab


def _digest(nb: nbformat.NotebookNode) -> str:
    """A hash of a lab's cells (sources and metadata), to tell a generated lab from an edited one."""
    cells = [(c.cell_type, c.source, json.dumps(c.get("metadata", {}), sort_keys=True)) for c in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:16]


def edited_since_generated(lab: nbformat.NotebookNode) -> bool:
    """True when a lab's cells differ from what `make_lab` wrote (someone worked in it)."""
    recorded = lab.get("metadata", {}).get("distlab", {}).get("generated")
    return recorded != _digest(lab) or any(c.get("outputs") for c in lab.cells if c.cell_type == "code")


def lab_path(solution_path: Path, labs_dir: Path) -> Path:
    return labs_dir / solution_path.name


def build_labs(root: Path = Path("."), *, check: bool = False, force: bool = False) -> tuple[list[Path], list[Path]]:
    """Write (or with `check`, compare) labs/NN_*.ipynb for each solutions/NN_*.ipynb.

    Returns (labs written or, with `check`, stale; labs refused because they
    were edited since they were generated: a learner's work, kept unless `force`).
    """
    changed, refused = [], []
    for sol in sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb")):
        lab = make_lab(nbformat.read(sol, as_version=4))
        target = lab_path(sol, root / "labs")
        text = nbformat.writes(lab) + "\n"
        if target.exists() and target.read_text() == text:
            continue
        if check:
            changed.append(target)
            continue
        if target.exists() and not force and edited_since_generated(nbformat.read(target, as_version=4)):
            refused.append(target)
            continue
        changed.append(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return changed, refused
