"""Build the notebook that grades one submission: the shipped lab, the learner's answers.

Only the learner's answer cells are taken from a submission. They are matched
to the shipped lab's answer cells (tag `answer`) by cell id, then by order
among the cells tagged `answer`, then by the names they define. Every other
cell, the graded check cells with their expected verdicts included, comes from
the shipped lab, so editing, deleting or moving a check cell changes nothing.
The answers are not put in the notebook as code: a grader cell hands their text
to `distlab.grading.remote`, which runs them on the ranks only.
"""
from __future__ import annotations

import ast
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from distlab.grading.remote import defined_names
from distlab.labs import ANSWER_TAG, is_check_cell

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Check:
    """One graded verdict line of the shipped lab."""
    cell: int            # index of its check cell among the check cells
    expected: str        # the committed line, e.g. "PASS all_gather, 2 ranks, values: ..."
    points: float

    @property
    def name(self) -> str:
        """For reports: the line without PASS and (a guess) without the detail after the last ': '."""
        rest = self.expected[5:] if self.expected.startswith("PASS ") else self.expected
        return rest.rsplit(": ", 1)[0]


@dataclass
class Lab:
    path: Path
    nb: nbformat.NotebookNode
    answer_cells: list = field(default_factory=list)   # [(cell id, [names])]
    checks: list = field(default_factory=list)         # [Check]

    @property
    def names(self) -> list[str]:
        return [n for _, names in self.answer_cells for n in names]

    def select(self, only: list[str] | None) -> "Lab":
        """Keep the verdict lines that contain one of `only` (all when None)."""
        if only:
            self.checks = [c for c in self.checks if any(s in c.expected for s in only)]
            if not self.checks:
                raise ValueError(f"no graded check of {self.path.name} matches {only}")
        return self


def _is_answer(cell) -> bool:
    return cell.cell_type == "code" and ANSWER_TAG in cell.get("metadata", {}).get("tags", [])


def _stdout_lines(cell) -> list[str]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [line for line in text.splitlines() if line.strip()]


def resolve_lab(lab: str | Path) -> Path:
    """`01_collectives`, `labs/01_collectives.ipynb` or any path to a shipped lab."""
    p = Path(lab)
    if p.suffix == ".ipynb" and p.exists():
        return p
    for cand in (ROOT / "labs" / f"{lab}.ipynb", Path("labs") / f"{lab}.ipynb"):
        if cand.exists():
            return cand
    hits = sorted((ROOT / "labs").glob(f"*{lab}*.ipynb"))
    if len(hits) == 1:
        return hits[0]
    raise FileNotFoundError(f"no shipped lab called {lab!r} (looked in {ROOT / 'labs'})")


def load_lab(lab: str | Path) -> Lab:
    path = resolve_lab(lab)
    nb = nbformat.read(path, as_version=4)
    out = Lab(path, nb)
    k = 0
    for cell in nb.cells:
        if _is_answer(cell):
            out.answer_cells.append((cell.get("id", ""), defined_names(cell.source)))
        elif cell.cell_type == "code" and is_check_cell(cell):
            pts = float(cell.metadata.get("distlab", {}).get("points", 1))
            lines = _stdout_lines(cell)
            if not lines:
                raise ValueError(f"{path}: a graded check cell has no committed verdict")
            out.checks += [Check(k, line, pts) for line in lines]
            k += 1
    if not out.checks:
        raise ValueError(f"{path} has no graded check cell (tag nbval-check-output)")
    return out


def read_submission(path: Path) -> tuple[nbformat.NotebookNode | None, str]:
    """(notebook, '') or (None, one-line reason)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        raw = json.loads(text)
    except OSError as exc:
        return None, f"cannot read the file: {exc.strerror or exc}"
    except json.JSONDecodeError as exc:
        return None, f"not a notebook: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
    try:
        return nbformat.reads(json.dumps(raw), as_version=4), ""
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds
        return None, f"not a notebook: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _defines_anything(cell) -> bool:
    tree = ast.parse(cell.source)
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.Import, ast.ImportFrom))
               for n in tree.body)


def _defines(cell, names: list[str]) -> bool:
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return False
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return bool(top & set(names))


def extract_answers(lab: Lab, sub: nbformat.NotebookNode) -> tuple[list[tuple[str, str]], list[str]]:
    """([(shipped id, learner source)], [notes on answer cells not found])."""
    code = [c for c in sub.cells if c.cell_type == "code" and not is_check_cell(c)]
    by_id = {c.get("id"): c for c in code if c.get("id")}
    tagged = [c for c in code if _is_answer(c)]
    same_shape = len(tagged) == len(lab.answer_cells)
    cells, notes = [], []
    for k, (cid, names) in enumerate(lab.answer_cells):
        cell = by_id.get(cid)
        if cell is None and same_shape:
            cell = tagged[k]
        if cell is None:
            cell = next((c for c in code if _defines(c, names)), None)
        if cell is None:
            notes.append(f"no answer cell for {', '.join(names)}")
            continue
        cells.append((cid, _without_magics(cell.source)))
    return cells, notes


def _without_magics(source: str) -> str:
    """IPython-only lines (%magic, !shell) become comments: answers run as plain Python on ranks."""
    return "\n".join(f"# (ignored by distlab grade) {line.strip()}" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


PREAMBLE = """# Added by distlab grade: the learner's answers exist only on the ranks.
import json as _dg_json
import distlab.grading.remote as _dg
_DG = _dg_json.load(open({path!r}))
_dg.cap_launch_timeout(_DG['rank_timeout'])"""

INSTALL = "_dg.install(_DG['cells'], _DG['names'], globals())"


def build(lab: Lab, answers: list[tuple[str, str]], workdir: Path, rank_timeout: float) -> nbformat.NotebookNode:
    """The notebook to execute: shipped cells up to the last check, answers bound to rank-only handles."""
    answers_file = workdir / "answers.json"
    answers_file.write_text(json.dumps({"cells": answers, "names": lab.names, "rank_timeout": rank_timeout}))
    nb = copy.deepcopy(lab.nb)
    check_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and is_check_cell(c)]
    last = check_cells[max(c.cell for c in lab.checks)]
    cells = [nbformat.v4.new_code_cell(PREAMBLE.format(path=str(answers_file)))]
    installed, k = False, -1
    graded = {c.cell for c in lab.checks}
    for cell in nb.cells[: last + 1]:
        if cell.cell_type != "code":
            continue
        if _is_answer(cell):
            if not installed:
                cells.append(nbformat.v4.new_code_cell(INSTALL))
                installed = True
            continue
        if is_check_cell(cell):
            k += 1
            cell.metadata["distlab_check_index"] = k
            if k not in graded and not _defines_anything(cell):
                continue   # not graded this time, and later checks need nothing from it
        if is_check_cell(cell):
            # Keep the expected verdicts, with an execution count: nbval skips (fails) "unrun" reference cells,
            # so the graded notebook also runs under `pytest --nbval-lax`.
            cell.execution_count = k + 1
        else:
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
    nb.cells = cells
    return nb
