"""What the planner is asked about (a workload on a cluster, one layout) and what it answers (a plan)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distlab.theory.hardware import GPU, H100
from distlab.theory.planning import NCCL_RING, Latency

GB = 1e9


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int               # sequences per optimizer step


@dataclass(frozen=True)
class Cluster:
    """GPUs, their network and what a training process cannot use of their memory.

    Headroom (defaults, typical orders of magnitude, not measured here): the CUDA context and kernels'
    workspaces (~0.5 GB per process), NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default, per channel and
    peer, for each communicator: dp, tp, pp, cp; ~1 GB), and the caching allocator's fragmentation.

    `kernel_efficiency`: the share of peak bf16 FLOP/s the step's kernels reach while nothing waits. None
    takes the GPU's measured matmul ceiling (`GPU.kernel_efficiency`: MAMF / peak, source in
    `distlab.theory.hardware`) — an upper bound: real steps also run memory-bound kernels, smaller
    matrices per GPU under tp, and clocks that throttle. The MFU each plan reaches is an output
    (`Plan.mfu`). `nic_GBps`: bandwidth between nodes per GPU and direction, from this cluster's NICs
    (`distlab.theory.planning.nic_GBps_per_gpu`); None takes the GPU's one-NIC-per-GPU figure.
    """

    gpus: int
    gpu: GPU = H100
    memory_GB: float | None = None  # default: the GPU's
    kernel_efficiency: float | None = None
    context_GB: float = 0.5         # CUDA context, cuBLAS/cuDNN workspaces
    nccl_GB: float = 1.0            # NCCL's communication buffers, all communicators
    fragmentation: float = 0.05     # share of the remaining memory lost to the allocator's fragmentation
    nic_GBps: float | None = None   # per GPU, per direction, between nodes; default: the GPU's ib_GBps
    latency: Latency = NCCL_RING    # per-call and per-hop latency of a collective

    @property
    def efficiency(self) -> float:
        return self.gpu.kernel_efficiency if self.kernel_efficiency is None else self.kernel_efficiency

    @property
    def mfu(self) -> float:
        """The kernels' efficiency (the name before issue 40): the most any plan's MFU can be."""
        return self.efficiency

    @property
    def ib_bytes_per_s(self) -> float:
        return (self.gpu.ib_GBps if self.nic_GBps is None else self.nic_GBps) * 1e9

    @property
    def memory_bytes(self) -> float:
        return (self.memory_GB or self.gpu.memory_GB) * GB

    @property
    def usable_bytes(self) -> float:
        """What the model's states, activations and buffers may fill: memory less the headroom."""
        return max(0.0, self.memory_bytes - (self.context_GB + self.nccl_GB) * GB) * (1 - self.fragmentation)


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out. `recompute`: "none", "selective" (Korthikanti et al. 2022: the attention
    core) or "full" (True and False still mean full and none). `v`: model chunks per pipeline rank (the
    interleaved 1F1B schedule when v > 1). `ep`: expert parallelism (a mixture of experts, chapter 10),
    carved out of dp: each group of ep data-parallel ranks splits a block's experts E/ep each, so ep
    divides dp; the dense parts stay data-parallel over dp, each expert over dp/ep. `etp`: the experts'
    tensor parallelism (`expert_tp`): 0, the default, follows tp (each expert split over tp like the dense MLP), or 1
    (Megatron Core's MoE Parallel Folding, Liu et al. 2025: experts whole, the MoE layers' mesh etp x ep x
    edp folded over the same tp x cp x dp ranks, ep innermost, so ep divides tp x cp x dp and an ep of 8
    beside tp = 2 stays in one node; each rank routes its own s/tp tokens, and the MLP's tp collectives
    go)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1
    micro_batch: int = 1
    m: int = 1                      # micro-batches per step (per pipeline)
    schedule: str = "1f1b"
    recompute: Any = "none"
    v: int = 1
    ep: int = 1
    etp: int = 0

    def __post_init__(self) -> None:
        if self.etp not in (0, 1, self.tp):
            raise ValueError(f"etp={self.etp}: experts are split over tp ({self.tp}: etp 0) or whole (1)")
        if self.folded:
            if self.ep < 1 or (self.tp * self.cp * self.dp) % self.ep:
                raise ValueError(f"ep={self.ep} must divide tp x cp x dp = {self.tp * self.cp * self.dp} (folded)")
        elif self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} "
                             "(experts are carved out of the data-parallel ranks)")
        rc = self.recompute
        if isinstance(rc, bool):
            rc = "full" if rc else "none"
        if rc not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE} (or True/False), got {self.recompute!r}")
        object.__setattr__(self, "recompute", rc)
        if self.v > 1 and self.schedule == "1f1b":
            object.__setattr__(self, "schedule", "interleaved")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """The ranks each expert is split over: tp, or 1 when folded."""
        return 1 if self.etp == 1 else self.tp

    @property
    def folded(self) -> bool:
        """MoE Parallel Folding: experts whole (etp = 1) beside tp > 1."""
        return self.expert_tp != self.tp

    @property
    def edp(self) -> int:
        """The replicas of one expert over which its states are sharded: (tp x dp) / (etp x ep) (cp left out,
        as dp's sharding leaves it out)."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    def __str__(self) -> str:
        extra = {"none": "", "full": ", recompute", "selective": ", selective recompute"}[self.recompute]
        chunks = f" v={self.v}" if self.v > 1 else ""
        experts = (f" ep={self.ep}" if self.ep > 1 else "") + (" etp=1" if self.folded else "")
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}{experts} ZeRO-{self.zero} "
                f"mb={self.micro_batch} m={self.m}{chunks}{extra}")


@dataclass(frozen=True)
class Plan:
    layout: Layout
    params_local: list[int]                       # per pipeline stage, on one device
    model_state_bytes: list[float]                # per stage: params + grads + optimizer
    activation_bytes: list[float]                 # per stage, at the schedule's peak
    traffic: dict[str, list[float]]               # group -> per stage, bytes one device sends per step
    links: dict[str, str] = field(default_factory=dict)   # group -> "nvlink" or "ib"
    bubble: float = 0.0
    step_s: float = 0.0
    fits: bool = True
    buffers: dict[str, list[float]] = field(default_factory=dict)   # per stage: logits, gathered units, fp32 grads
    mfu: float = 0.0                              # model FLOPs (6 per weight + attention) / (devices x peak x step_s)
    times: dict[str, float] = field(default_factory=dict)   # the step's parts, seconds: compute, bubble, tp, ...
    cluster: Cluster | None = None

    @property
    def buffer_bytes(self) -> list[float]:
        """Per stage: the buffers beside model states and block activations (sum of `buffers`)."""
        return [sum(v[r] for v in self.buffers.values()) for r in range(len(self.model_state_bytes))]

    @property
    def memory_bytes(self) -> float:
        """The busiest device: model states + activations + buffers, maximised over stages."""
        extra = self.buffer_bytes
        return max(s + a + e for s, a, e in zip(self.model_state_bytes, self.activation_bytes, extra))

    @property
    def frameworks(self) -> str:
        """Which frameworks can run this layout as it is (2025)."""
        return frameworks(self.layout)

    def link_bytes(self) -> dict[str, float]:
        """Bytes one device of the busiest stage sends per step on each kind of link."""
        out = {"nvlink": 0.0, "ib": 0.0}
        for group, per_stage in self.traffic.items():
            out[self.links.get(group, "nvlink")] += max(per_stage)
        return out


def frameworks(layout: Layout) -> str:
    """Frameworks that offer `layout` as such (2025). ZeRO-2/3 with a pipeline is not offered by
    DeepSpeed's pipeline engine (ZeRO-1 only) nor by Megatron-LM (its distributed optimizer is
    ZeRO-1); torchtitan composes FSDP2 (ZeRO-3, or ZeRO-2 with reshard_after_forward=False) with
    `torch.distributed.pipelining`. DeepSpeed's pipeline engine runs 1F1B only (no interleaving).
    Expert parallelism (ep > 1): Megatron-LM (Megatron Core MoE: ep with tp, pp, cp and its distributed
    optimizer), torchtitan (ep with FSDP2, tp, pp), DeepSpeed-MoE (ep with ZeRO-1/2 data parallelism, no
    pipeline)."""
    L = layout
    if L.folded:
        return "Megatron-LM (MoE Parallel Folding), torchtitan" if L.zero <= 1 else "torchtitan only"
    if L.ep > 1:
        names = ["Megatron-LM"] if L.zero <= 1 else []
        names.append("torchtitan")
        if L.pp == 1 and L.cp == 1 and L.zero <= 2:
            names.append("DeepSpeed-MoE")
        return ", ".join(names) + (" only" if len(names) == 1 else "")
    if L.pp > 1:
        if L.zero >= 2:
            return "torchtitan (FSDP2 + pipelining) only"
        if L.v > 1:
            return "Megatron-LM, torchtitan"
        return "Megatron-LM, DeepSpeed pipeline engine, torchtitan"
    if L.tp > 1 or L.cp > 1:
        return "Megatron-LM, torchtitan" + (", DeepSpeed (with Megatron's tp)" if L.cp == 1 else "")
    return "DeepSpeed ZeRO, FSDP2 / torchtitan" + (", Megatron-LM" if L.zero <= 1 else "")
