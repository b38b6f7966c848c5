"""Generate `labs/` from `solutions/`: answers out, graded checks kept.

In a solution notebook every answer sits between fence lines:

    def ring_all_reduce(tensor):
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

The lab keeps the `def` line and replaces the fenced block with
`raise NotImplementedError(...)` at the same indentation. Outputs are
cleared, except those of graded check cells (tag `nbval-check-output`):
they keep the solution's verdicts, which nbval compares against. The
unfilled lab therefore fails exactly its graded checks.

    distlab labs           # regenerate labs/ from solutions/
    distlab labs --check   # exit 1 if labs/ is out of date
"""
from __future__ import annotations

import copy
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


def make_lab(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The learner's version of an (executed) solution notebook."""
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
            # Keep only the verdict text nbval compares against, and an execution
            # count: nbval refuses reference outputs on a cell marked unrun.
            cell.outputs = [o for o in cell.outputs if o.get("output_type") == "execute_result"
                            or (o.get("output_type") == "stream" and o.get("name") == "stdout")]
        else:
            cell.outputs = []
            cell.execution_count = None
    return lab


def lab_path(solution_path: Path, labs_dir: Path) -> Path:
    return labs_dir / solution_path.name


def sync_labs(root: Path = Path("."), *, check: bool = False) -> list[Path]:
    """Write (or with `check`, compare) labs/NN_*.ipynb for each solutions/NN_*.ipynb.

    Returns the labs that were (or, with `check`, would be) changed.
    """
    changed = []
    for sol in sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb")):
        lab = make_lab(nbformat.read(sol, as_version=4))
        target = lab_path(sol, root / "labs")
        text = nbformat.writes(lab) + "\n"
        if target.exists() and target.read_text() == text:
            continue
        changed.append(target)
        if not check:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return changed


