"""`distlab export`: a lab's answer cells as an importable module, plus a job that runs them under torchrun.

    distlab export 05_zero3 labs/05_zero3.ipynb -o job/     # your notebook
    distlab export 05_zero3 -o job/                          # the shipped solution
    distlab export 02_ddp labs/02_ddp.ipynb 05_zero3 -o job/ # several labs, one job

writes into `job/`:

- `answers_05_zero3.py`: the lab's PRELUDE (its imports) and your answer cells, in order;
- `job.py`: runs each chapter's training measurement with your classes on every rank
  (`distlab.apps.cluster.main`), on one node or many;
- `job.sbatch`: a Slurm template that starts one torchrun agent per node;
- `README.md`: the commands, the environment variables, how to read the records.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import nbformat

from distlab.checks.labs import ANSWER_TAG, BEGIN, END

ROOT = Path(__file__).resolve().parents[2]


def answer_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The answer cells of a lab notebook: a solution's fenced cells (fences dropped), or a
    learner's cells tagged `answer` (the lab builder tags them)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        if BEGIN in cell.source:
            out.append("\n".join(line for line in cell.source.splitlines() if line.strip() not in (BEGIN, END)))
        elif ANSWER_TAG in tags:
            out.append(cell.source)
    return out


def _plain_python(source: str) -> str:
    """IPython-only lines (%magic, !shell) become comments: the module is plain Python."""
    return "\n".join(f"# (not Python, left out) {line.strip()}" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def module_source(lab: str, notebook: Path) -> str:
    from distlab.checks import lab_module
    cells = answer_cells(nbformat.read(notebook, as_version=4))
    if not cells:
        raise ValueError(f"{notebook} has no answer cells (cells tagged '{ANSWER_TAG}', or fenced with {BEGIN!r})")
    body = "\n\n\n".join(_plain_python(c) for c in cells)
    return (f'"""The answers of lab {lab}, exported from {notebook.name} by `distlab export`."""\n'
            f"{lab_module(lab).PRELUDE}\n\n\n{body}\n")


JOB = '''"""Run the training measurement of lab(s) {labs} with your exported classes, on every rank.

    torchrun --nproc-per-node N job.py --out results/                        # one node
    torchrun --nnodes M --node-rank K --nproc-per-node N \\\\
             --rdzv-backend c10d --rdzv-endpoint HOST:29500 job.py --out results/   # M nodes
"""
import os
import sys

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # before torch loads: c10d's C++ warnings, not ours
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distlab.apps.cluster  # noqa: E402
{imports}

if __name__ == "__main__":
    sys.exit(distlab.apps.cluster.main({labs!r}, [{modules}]))
'''

SBATCH = '''#!/bin/bash
# Slurm: one task (one torchrun agent) per node; torchrun starts one rank per GPU on its node.
#SBATCH --job-name=distlab-job
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=00:20:00
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export DISTLAB_RESULTS=${DISTLAB_RESULTS:-$PWD/results}
# NCCL picks InfiniBand when the nodes have it; NCCL_DEBUG=INFO prints the transport it chose.
# On nodes without InfiniBand, NCCL falls back to sockets: NCCL_SOCKET_IFNAME=<interface> picks the network.
srun torchrun --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node "${SLURM_GPUS_ON_NODE:-8}" \\
     --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \\
     job.py --out "$DISTLAB_RESULTS"
'''

README = '''# Labs {labs} on a cluster

`answers_<lab>.py` holds your answer cells of each lab; `job.py` trains the course model with them
and measures what `distlab tour` measures. The same script runs everywhere; torchrun starts the ranks:

    torchrun --nproc-per-node 4 job.py --out results/                 # one machine, 4 ranks

    # two machines: the same command on each, --node-rank 0 on the first, 1 on the second
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
             --rdzv-backend c10d --rdzv-endpoint FIRST_HOST:29500 job.py --out results/

    sbatch job.sbatch                                                  # Slurm starts the agents

- One rank per GPU: with a GPU for every local rank the job uses NCCL (InfiniBand between nodes
  when present, sockets otherwise); without, gloo on the CPU.
- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node), MASTER_ADDR,
  MASTER_PORT; distlab reads them (`distlab.run_under_torchrun`).
- Records: every node writes `results/node<K>.jsonl` (one line per rank on it and per lab: its
  samples/s, memory, bytes sent per step); rank 0 appends to `results/strategies.jsonl` one line per lab,
  with `max_abs_param_diff_vs_single` (your trained weights against one process on the full batch)
  and the same fields as the tour's strategy records.
- A rank that fails prints its rank, node and host; when no rank on any node makes progress for
  `--stall` seconds (default 60), every rank prints where it waits and the job ends.
'''


def export(labs: list[tuple[str, Path | None]], out: Path) -> list[Path]:
    """Write a module per lab, the job script, the Slurm template and the README; return their paths.

    `labs`: (lab, notebook) pairs; notebook None means the shipped solution.
    """
    from distlab.apps.cluster import STRATEGIES
    files: dict[str, str] = {}
    for lab, notebook in labs:
        if lab not in STRATEGIES:
            raise ValueError(f"lab {lab!r} has no cluster job yet; labs with one: {sorted(STRATEGIES)}")
        files[f"answers_{lab}.py"] = module_source(lab, Path(notebook or ROOT / "solutions" / f"{lab}.ipynb"))
    names = [lab for lab, _ in labs]
    modules = [f"answers_{lab}" for lab in names]
    files["job.py"] = JOB.format(labs=names, modules=", ".join(modules),
                                 imports="\n".join(f"import {m}  # noqa: E402" for m in modules))
    files["job.sbatch"] = SBATCH
    files["README.md"] = README.format(labs=", ".join(names))
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]


def parse_labs(tokens: list[str]) -> list[tuple[str, Path | None]]:
    """['02_ddp', 'my.ipynb', '05_zero3'] -> [('02_ddp', Path('my.ipynb')), ('05_zero3', None)]."""
    out: list[tuple[str, Path | None]] = []
    for token in tokens:
        if token.endswith(".ipynb"):
            if not out or out[-1][1] is not None:
                raise ValueError(f"{token}: name its lab first (distlab export LAB [NOTEBOOK] ...)")
            out[-1] = (out[-1][0], Path(token))
        else:
            out.append((token, None))
    if not out:
        raise ValueError("name at least one lab")
    return out


def add_parser(sub):
    e = sub.add_parser("export", help="a lab's answer cells as a module + a torchrun job script (leaving one machine)")
    e.add_argument("labs", nargs="+", metavar="LAB [NOTEBOOK]",
                   help="a lab (02_ddp, 05_zero3), optionally followed by your notebook (default: the solution)")
    e.add_argument("-o", "--out", type=Path, required=True, help="folder to write the job into")
    return e


def run(args: argparse.Namespace) -> int:
    try:
        paths = export(parse_labs(args.labs), args.out)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"distlab export: {exc}")
        return 2
    for p in paths:
        print(f"wrote {p}")
    print(f"next: cd {args.out} && torchrun --nproc-per-node 2 job.py --out results/")
    return 0
