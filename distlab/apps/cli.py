"""The `distlab` command. Each subcommand lives with its code: a module that defines
`add_parser(subparsers)` (returning its parser) and `run(args) -> int`.

    distlab tour          run every chapter's measurements on this machine (the main job)
    distlab train         train the course GPT on real text (the stdlib's source) with a strategy, checkpoints, --resume
    distlab doctor        what this machine can run; --run proves it, --gpu checks the course on GPUs
    distlab simulate      one training step at any size (7.5B on 64 ranks), measured on fake tensors
    distlab grade         grade learners' lab notebooks (instructors)
    distlab export        a lab's answers as a module + a torchrun job script (leaving one machine)
    distlab nbgrader-source  the labs as an nbgrader course (instructors who grade with nbgrader)
    distlab build-labs    regenerate labs/ from solutions/ (maintainers)
"""
from __future__ import annotations

import argparse
import importlib
import sys

from distlab.engine.lazyimports import defer_rfc3987_syntax

# In the order `--help` lists them: the learner's commands first, the maintainer's last.
SUBCOMMANDS = ("distlab.apps.tour", "distlab.apps.train", "distlab.apps.doctor", "distlab.apps.simulate", "distlab.grading.cli", "distlab.apps.export",
               "distlab.apps.nbgrader_course", "distlab.apps.build_labs")


def main(argv: list[str] | None = None) -> int:
    defer_rfc3987_syntax()     # before anything imports nbformat: the tour and the grader read notebooks
    ap = argparse.ArgumentParser(prog="distlab", description="A measured course in distributed training.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    runners = {}
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:   # the module exists but something it imports is missing
                raise
            continue
        parser = module.add_parser(sub)
        runners[parser.prog.split()[-1]] = module.run
    args = ap.parse_args(argv)
    return runners[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
