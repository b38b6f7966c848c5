"""Print the planner's reading of published layouts (issue 40): rank, estimated step against the planner's
favourite, MFU against the published one. The runs, their sources and the comparison live in
distlab/course/planner/published.py; this script loads that file by path, so that it also runs against the
planner before issue 40 (see that module's docstring).

    .venv/bin/python tools/planner_vs_published.py [--sources] [--terms] [--moe]

With a planner that knows expert parallelism (issue 37) it also reads the published Mixtral layouts
(`published.MOE_RUNS`); --moe reads only those.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "distlab" / "course" / "planner" / "published.py"
_spec = importlib.util.spec_from_file_location("published_runs", FILE)
published = importlib.util.module_from_spec(_spec)
sys.modules["published_runs"] = published           # dataclasses look their module up
_spec.loader.exec_module(published)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", action="store_true", help="print each run's source and notes")
    parser.add_argument("--terms", action="store_true", help="print the step's terms, published vs best")
    parser.add_argument("--moe", action="store_true", help="only the mixtures of experts (issue 37)")
    args = parser.parse_args()
    runs = [] if args.moe else list(published.RUNS)
    moe = list(getattr(published, "MOE_RUNS", [])) if getattr(published, "MOE_API", False) else []
    print(f"planner API: {'issue 40' if published.NEW_API else 'before issue 40 (legacy path)'}"
          + (", expert parallelism (issue 37)" if moe else ""))
    rows = [published.compare(run) for run in runs]
    if rows:
        print(published.table(rows))
    if moe:
        moe_rows = [published.compare(run) for run in moe]
        print("\nMixtures of experts:")
        print(published.table(moe_rows))
        rows += moe_rows
    if args.terms and published.NEW_API:
        for r in rows:
            for who in ("pub", "best"):
                t = r[who].times
                print(f"{r['run'].name:32s} {who:4s} {r[who].step_s:8.2f} s: " + " ".join(f"{k} {x:.2f}" for k, x in t.items())
                      + f"  mem {r[who].memory_bytes / 1e9:.0f} GB")
    if args.sources:
        for r in rows:
            print(f"- {r['run'].name}: {r['run'].source}. {r['run'].notes}")


if __name__ == "__main__":
    main()
