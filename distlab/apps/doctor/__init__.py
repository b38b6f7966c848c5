"""`distlab doctor`: what this machine can run (`local`), the whole course on its GPUs (`gpu`), and the
first minutes on a GPU box (`smoke`: `--gpu --smoke`, `--dry-run` on any machine).

The command lives here; `local` (the report and the short job of `--run`) and
`gpu` (`--gpu`) are imported when asked for, so neither imports the other's command.
"""
from __future__ import annotations


def add_parser(sub):
    d = sub.add_parser("doctor", help="what this machine can run (backend, GPUs, bf16, world sizes)")
    d.add_argument("--run", action="store_true", help="also launch a short job on every usable backend")
    d.add_argument("--gpu", action="store_true",
                   help="check the whole course on this machine's GPUs: NCCL, GPU tests, every chapter (minutes)")
    d.add_argument("--smoke", "--quick", action="store_true",
                   help="with --gpu: the first minutes on a GPU box, most informative check first, within --budget")
    d.add_argument("--dry-run", action="store_true",
                   help="with --gpu --smoke: list every step and run the CPU stand-ins (any machine, < 1 min)")
    d.add_argument("--budget", type=float, default=360.0, metavar="S",
                   help="with --smoke: seconds for the whole check (default 360: two runs fit in 15 minutes)")
    return d


def run(args) -> int:
    if args.gpu and (args.smoke or args.dry_run):
        from distlab.apps.doctor.smoke import smoke
        return smoke(dry_run=args.dry_run, budget_s=args.budget)
    if args.gpu:
        from distlab.apps.doctor.gpu import gpu_check
        return gpu_check()
    from distlab.apps.doctor.local import doctor
    return doctor(run=args.run)
