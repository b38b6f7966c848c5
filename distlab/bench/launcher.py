"""How long `distlab.launch` takes: the first launch in a fresh process, then relaunches.

    python -m distlab.bench.launcher --world-sizes 2 4 --repeats 5

The first launch pays for starting the forkserver (which imports torch once);
each relaunch forks ranks from it and only sets up the process group. Run it
in a fresh process (the tour does), or the first launch is not the first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from distlab.engine.launch import launch


def _noop() -> int:
    return 0


def measure(world_sizes: list[int], repeats: int) -> list[dict]:
    """One record per world size: first_launch_s (first in this process), relaunch_s (median)."""
    out = []
    for n in world_sizes:
        start = time.perf_counter()
        launch(_noop, n)
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            launch(_noop, n)
            times.append(time.perf_counter() - start)
        out.append({"world_size": n, "first_launch_s": first, "relaunch_s": statistics.median(times),
                    "relaunch_min_s": min(times), "repeats": repeats})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.world_sizes, args.repeats)))


if __name__ == "__main__":
    main()
