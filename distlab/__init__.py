"""distlab: measured distributed training, from collectives to FSDP, on CPU or GPUs.

    import distlab
    distlab.launch(fn, 4)      # run fn on 4 ranks (NCCL with GPUs, gloo on CPU)
"""
from distlab.engine.launch import LaunchError, LaunchStalled, LaunchTimeout, RankFailed, launch
from distlab.engine.quickmode import pick, quick
from distlab.engine.runtime import backend, device, local_rank, mesh, print0, rank, run_under_torchrun, world_size
from distlab.meters.records import record
from distlab.course.stepwise import add_to_class

__all__ = [
    "LaunchError", "LaunchStalled", "LaunchTimeout", "RankFailed", "launch",
    "pick", "quick",
    "backend", "device", "local_rank", "mesh", "print0", "rank", "run_under_torchrun", "world_size",
    "record", "add_to_class",
]
__version__ = "0.1.0"
