"""The seed's table by measurement: 7.5B parameters on 64 ranks, DDP / ZeRO-1 / ZeRO-2 / ZeRO-3 (the shipped
solutions' classes) and FSDP2, each simulated as rank 0 of 64 on fake tensors, and how long that took.

    .venv/bin/python tools/simulate_bench.py                  # 7.5e9 on 64
    .venv/bin/python tools/simulate_bench.py --params 70e9 --world-size 512

Target: the four ZeRO stages in under 60 s on a 2-core laptop CPU (it prints the seconds; no test times it).
"""
from __future__ import annotations

import argparse
import time

from distlab.apps.simulate import lab_class
from distlab.course import sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=7.5e9)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--no-fsdp2", action="store_true", help="the four ZeRO stages only")
    args = ap.parse_args()
    names = ["ddp", "zero1", "zero2", "zero3"] + ([] if args.no_fsdp2 else ["fsdp2"])
    classes = {k: v for n in names for k, v in lab_class(n).items()}
    start = time.perf_counter()
    results, cpu = [], {}
    for name in names:
        cpu0 = time.process_time()
        results.append(sim.simulate(name, num_params=args.params, world_size=args.world_size, classes=classes))
        cpu[name] = time.process_time() - cpu0
        print(f"  {name}: {results[-1].seconds:.1f} s ({cpu[name]:.1f} s of CPU)", flush=True)
    total = time.perf_counter() - start
    four = sum(r.seconds for r in results if r.strategy != "fsdp2")
    four_cpu = sum(v for k, v in cpu.items() if k != "fsdp2")
    print()
    print(sim.describe(results[0]))
    print()
    print(sim.markdown(results))
    print()
    zero3, zero1 = (next(r for r in results if r.strategy == s) for s in ("zero3", "zero1"))
    print(f"traffic ZeRO-3 / ZeRO-1: {zero3.comm_bytes_per_step / zero1.comm_bytes_per_step:.4f} (theory 3Ψ / 2Ψ = 1.5)")
    print(f"seconds: {four:.1f} for the four ZeRO stages ({four_cpu:.1f} s of CPU: the wall time on an idle core), "
          f"{total:.1f} in all")


if __name__ == "__main__":
    main()
