"""Reading a learner's notebook defensively and taking only its answer cells.

Only the answer cells of a submission are used: everything else (setup,
check cells, outputs, metadata) comes from the shipped lab and the lab's
check module, so editing, deleting or moving a check cell changes nothing.
Answer cells are matched to the shipped lab's (tag `answer`) by cell id,
then by order among cells tagged `answer` (when there are as many), then by
the names they define. IPython-only lines (`%magic`, `!shell`) become
comments: the cells run as plain Python on the ranks.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distlab.grading.lab import ShippedLab, defined_names
from distlab.checks.labs import ANSWER_TAG, CHECK_TAG

MAX_FILE_BYTES = 20 << 20        # a lab notebook with outputs is well under this
MAX_CELL_CHARS = 200_000


class BadSubmission(ValueError):
    """The file cannot be graded; the message is the one-line reason for the report."""


def _cells(raw: Any) -> list[dict]:
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        raise BadSubmission("not a notebook: no list of cells")
    out = []
    for cell in raw["cells"]:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            continue
        meta = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        tags = meta.get("tags") if isinstance(meta.get("tags"), list) else []
        cid = cell.get("id") if isinstance(cell.get("id"), str) else ""
        out.append({"id": cid, "source": source, "tags": [t for t in tags if isinstance(t, str)]})
    return out


def read(path: Path) -> list[dict]:
    """The code cells of a submission ({id, source, tags}); BadSubmission with a one-line reason."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadSubmission(f"the file is {size / 2**20:.0f} MiB (limit {MAX_FILE_BYTES >> 20} MiB): "
                                "clear its outputs and hand it in again")
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise BadSubmission(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadSubmission(f"not a notebook: invalid JSON at line {exc.lineno} column {exc.colno} "
                            f"({exc.msg})") from None
    except RecursionError:
        raise BadSubmission("not a notebook: JSON nested too deep") from None
    return _cells(raw)


def without_magics(source: str) -> str:
    """IPython-only lines become comments (answers run as plain Python on the ranks)."""
    return "\n".join(f"# (ignored by distlab grade) {line.strip()}" if line.lstrip().startswith(("%", "!"))
                     else line for line in source.splitlines())


def answers(lab: ShippedLab, cells: list[dict]) -> tuple[list[tuple[str, str]], list[str]]:
    """([(shipped cell id, learner source)] in the shipped order, [notes on answer cells not found])."""
    code = [c for c in cells if CHECK_TAG not in c["tags"]]
    by_id = {c["id"]: c for c in code if c["id"]}
    tagged = [c for c in code if ANSWER_TAG in c["tags"]]
    same_shape = len(tagged) == len(lab.answer_cells)
    out, notes = [], []
    for k, (cid, names) in enumerate(lab.answer_cells):
        cell = by_id.get(cid)
        if cell is None and same_shape:
            cell = tagged[k]
        if cell is None:
            cell = next((c for c in code if set(defined_names(without_magics(c["source"]))) & set(names)), None)
        if cell is None:
            notes.append(f"no answer cell for {', '.join(names) or cid}")
            continue
        if len(cell["source"]) > MAX_CELL_CHARS:
            notes.append(f"the answer cell for {', '.join(names)} is over {MAX_CELL_CHARS} characters: not run")
            continue
        out.append((cid, without_magics(cell["source"])))
    return out, notes
