"""`distlab doctor`: what this machine can run (`local`), and the whole course on its GPUs (`gpu`).

The command lives here; `local` (the report and the short job of `--run`) and
`gpu` (`--gpu`) are imported when asked for, so neither imports the other's command.
"""
from __future__ import annotations


def add_parser(sub):
    d = sub.add_parser("doctor", help="what this machine can run (backend, GPUs, bf16, world sizes)")
    d.add_argument("--run", action="store_true", help="also launch a short job on every usable backend")
    d.add_argument("--gpu", action="store_true",
                   help="check the whole course on this machine's GPUs: NCCL, GPU tests, every chapter (minutes)")
    return d


def run(args) -> int:
    if args.gpu:
        from distlab.apps.doctor.gpu import gpu_check
        return gpu_check()
    from distlab.apps.doctor.local import doctor
    return doctor(run=args.run)
