"""`distlab simulate`: one training step of a strategy at any size, measured as rank 0 of N on fake tensors.

    distlab simulate --strategy zero3 --params 7.5e9 --world-size 64
    distlab simulate --strategy all --params 70e9 --world-size 512
    distlab simulate --strategy zero2 --notebook labs/04_zero2.ipynb --params 7.5e9 --world-size 64   # your class

ZeRO-1/2/3 run the lab's class: from your notebook (`--notebook`), else the shipped solution. Nothing real
is allocated and nothing is sent (`distlab.course.sim`); time is not simulated.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from distlab.course import sim

ROOT = Path(__file__).resolve().parents[2]


def lab_class(strategy: str, notebook: Path | None = None) -> dict[str, Any]:
    """{class name: class} for a ZeRO strategy, from `notebook`'s answer cells (default: the solution)."""
    if strategy not in sim.LAB_CLASS:
        return {}
    from distlab.apps.export import module_source
    lab, name = sim.LAB_CLASS[strategy]
    path = notebook or ROOT / "solutions" / f"{lab}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass --notebook with your lab {lab} notebook (it defines {name})")
    ns: dict[str, Any] = {"__name__": f"answers_{lab}"}
    exec(compile(module_source(lab, path), str(path), "exec"), ns)  # noqa: S102 - the learner's own answers
    if name not in ns:
        raise ValueError(f"{path} defines no class {name}: strategy {strategy} needs lab {lab}'s {name}")
    return {name: ns[name]}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser("simulate", help="model states, peak and traffic of one step at any size, on fake tensors")
    s.add_argument("--strategy", default="all",
                   help=f"one of {', '.join(sim.STRATEGIES)}, a comma-separated list, or 'all' (the four ZeRO stages)")
    s.add_argument("--params", type=float, default=7.5e9, help="parameters Ψ (default 7.5e9)")
    s.add_argument("--world-size", type=int, default=64, help="data-parallel ranks N (default 64)")
    s.add_argument("--micro-batch", type=int, default=1, help="rows per rank (default 1)")
    s.add_argument("--notebook", type=Path, default=None,
                   help="your lab notebook with the strategy's class (default: the shipped solution)")
    return s


def run(args: argparse.Namespace) -> int:
    names = ["ddp", "zero1", "zero2", "zero3"] if args.strategy == "all" else args.strategy.split(",")
    unknown = [n for n in names if n not in sim.STRATEGIES]
    if unknown:
        print(f"distlab simulate: unknown strategy {', '.join(unknown)}; choose from {', '.join(sim.STRATEGIES)} or all")
        return 2
    if args.world_size < 1 or args.params <= 0:
        print("distlab simulate: --world-size must be >= 1 and --params > 0")
        return 2
    try:
        classes = {k: v for n in names for k, v in lab_class(n, args.notebook).items()}
    except (FileNotFoundError, ValueError) as exc:
        print(f"distlab simulate: {exc}")
        return 2
    start = time.perf_counter()
    results = [sim.simulate(n, num_params=args.params, world_size=args.world_size, classes=classes,
                            micro_batch=args.micro_batch) for n in names]
    print(sim.describe(results[0]))
    print()
    print(sim.markdown(results))
    print()
    print(f"{len(results)} simulation(s) in {time.perf_counter() - start:.1f} s on this machine. "
          "What a fake run cannot tell: time, the allocator's rounding and fragmentation, NCCL's buffers.")
    return 0
