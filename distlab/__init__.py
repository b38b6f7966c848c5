"""distlab: measured distributed training, from collectives to FSDP, on CPU or GPUs."""
from distlab.launch import LaunchError, LaunchTimeout, RankFailed, launch
from distlab.rank import backend, device, local_rank, print0, rank, run_under_torchrun, world_size

__all__ = [
    "LaunchError", "LaunchTimeout", "RankFailed", "launch",
    "backend", "device", "local_rank", "print0", "rank", "run_under_torchrun", "world_size",
]
__version__ = "0.1.0"
