"""The hardware figures every chapter's "what a GPU cluster would do" arithmetic uses, in one place.

These are vendors' nominal figures (per GPU, per direction), not measurements:
prose that uses them says so; the one measured figure, `mamf_TFLOPs` (the best
matmul FLOP/s found, hence `kernel_efficiency`), names its source. One node
holds 8 GPUs joined all-to-all by NVLink through NVSwitch; each GPU has its own
InfiniBand NIC to other nodes (`ib_GBps`). Real clusters differ (4 x 100 Gb/s
per 8 GPUs on some A100 machines): the planner's `Cluster(nic_GBps=...)` takes a
cluster's own figure (`distlab.theory.planning.nic_GBps_per_gpu`).

    from distlab.theory.hardware import H100
    H100.nvlink_GBps / H100.ib_GBps     # 9.0: inside a node vs across nodes, per GPU
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_GB: float          # HBM per GPU
    bf16_TFLOPs: float        # dense bf16 tensor-core peak
    nvlink_GBps: float        # NVLink bandwidth per GPU, per direction
    ib_GBps: float            # one InfiniBand NIC per GPU, per direction
    nvlink_name: str
    ib_name: str
    gpus_per_node: int = 8
    mamf_TFLOPs: float = 0.0  # measured: the largest bf16 matmul FLOP/s found over shapes (0: unknown)

    @property
    def kernel_efficiency(self) -> float:
        """The share of peak bf16 FLOP/s a matrix product reaches at best, measured (MAMF / peak): the
        ceiling of what a training step's kernels reach while nothing waits. 0.4 when not measured."""
        return self.mamf_TFLOPs / self.bf16_TFLOPs if self.mamf_TFLOPs else 0.4

    @property
    def node_gap(self) -> float:
        """How many times more bandwidth a GPU has to its node's peers than to other nodes."""
        return self.nvlink_GBps / self.ib_GBps


# Maximum achievable matmul FLOP/s (MAMF, bf16, best shape found by mamf-finder.py; mean of 100 runs):
# S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table" (github.com/stas00/ml-engineering): A100 SXM 271.2 of 312 (86.9 %, torch 2.6.0+cu126),
# H100 SXM 794.5 of 989 (80.3 %, torch 2.7.0+cu126).
MAMF_SOURCE = "Bekman, ml-engineering, MAMF table (mamf-finder.py, bf16)"
# A100 SXM 80 GB: NVLink 3 (12 links x 25 GB/s), HDR InfiniBand 200 Gb/s.
A100 = GPU("A100 80GB SXM", 80, 312, 300, 25, "NVLink 3", "HDR InfiniBand (200 Gb/s)", mamf_TFLOPs=271.2)
# H100 SXM: NVLink 4 (18 links x 25 GB/s), NDR InfiniBand 400 Gb/s.
H100 = GPU("H100 SXM", 80, 989, 450, 50, "NVLink 4", "NDR InfiniBand (400 Gb/s)", mamf_TFLOPs=794.5)
# PCIe 4.0 x16 (host <-> GPU, and GPU <-> GPU on machines without NVLink), per direction.
PCIE4_X16_GBps = 32.0
PCIE5_X16_GBps = 64.0

# The GPU the course's cluster arithmetic assumes unless a cell says otherwise.
DEFAULT = H100
