"""Measured records that notebooks and benchmarks write, and the tour gathers.

    distlab.record("strategies", name="ddp_torch", world_size=2, samples_per_s=812.0)

appends one JSON line to `<results>/strategies.jsonl`, where <results> is
$DISTLAB_RESULTS (the tour sets it) or ./results.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def yours_dir() -> Path:
    """Where records of notebooks run by hand go: the checkout's results/yours/ (an editable install, as the
    README sets up), else ./results/yours."""
    root = Path(__file__).resolve().parents[2]
    base = root / "results" if (root / "notebooks").is_dir() else Path("results")
    return base / "yours"


def results_dir() -> Path:
    env = os.environ.get("DISTLAB_RESULTS")
    return Path(env) if env else yours_dir()


def _plain(value: Any) -> Any:
    """JSON-friendly: dataclasses to dicts, tensors to numbers/lists."""
    import dataclasses

    import torch
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def record(section: str, **fields: Any) -> dict[str, Any]:
    """Append one measured record to `<results>/<section>.jsonl`; returns it."""
    if not section.isidentifier():
        raise ValueError(f"section must be a plain name like 'strategies', got {section!r}")
    rec = _plain(fields)
    if not os.environ.get("DISTLAB_RESULTS"):
        rec.setdefault("source", "learner")   # run by hand: the tour's report calls it "yours"
    path = results_dir() / f"{section}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def load_records(folder: str | Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every section's records under `folder`, in the order they were written."""
    folder = Path(folder) if folder is not None else results_dir()
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        out[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out
