"""Every layout of a cluster, ranked; who runs a layout; the ranked table with the planner's assumptions."""
from __future__ import annotations

from typing import Any

from distlab.course.planner.estimate import BUCKET_BYTES, plan
from distlab.course.planner.layout import GB, Cluster, Layout, Plan, Workload, frameworks
from distlab.course.planner.shapes import ModelSpec
from distlab.theory.hardware import MAMF_SOURCE


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(spec: ModelSpec, workload: Workload, cluster: Cluster, cp_sizes: tuple[int, ...],
           ep_sizes: tuple[int, ...] | None = None) -> list[dict[str, int]]:
    """Every way to factor the cluster's GPUs into the mesh axes, innermost first (`estimate.AXES`), each
    axis by its own rule: tp divides the heads and stays in a node; cp splits sequences of 8k tokens or
    more, at least 2k per rank; pp <= layers; dp takes the rest; ep (a mixture of experts) divides dp and
    the number of experts, `ep_sizes` (default: every such divisor); with tp > 1 also folded (etp = 1:
    experts whole, ep divides tp x cp x dp; `Layout.etp`)."""
    out = []
    for tp in [t for t in _divisors(cluster.gpus) if t <= cluster.gpu.gpus_per_node and spec.n_heads % t == 0]:
        for cp in [c for c in cp_sizes if c == 1 or (workload.seq_len >= 8192 and workload.seq_len // c >= 2048)]:
            if (cluster.gpus // tp) % cp:
                continue
            for pp in [p for p in _divisors(cluster.gpus // (tp * cp)) if p <= spec.n_layers]:
                dp = cluster.gpus // (tp * cp * pp)
                for etp in (tp, 1) if spec.moe and tp > 1 else (tp,):
                    ranks = dp if etp == tp else tp * cp * dp        # folded: ep over tp x cp x dp
                    eps = [e for e in _divisors(ranks) if spec.moe and spec.n_experts % e == 0
                           and (ep_sizes is None or e in ep_sizes) and (etp == tp or e > 1)] or [1]
                    for ep in eps:
                        out.append({"tp": tp, "cp": cp, "ep": ep, "etp": etp, "dp": dp, "pp": pp})
    return out


def rank_key(p: Plan) -> tuple:
    """How `candidates` orders plans: layouts that fit first, then estimated step time (to the
    millisecond), then bytes sent (ties when dp traffic hides under the backward), then memory."""
    return (not p.fits, round(p.step_s, 3), sum(p.link_bytes().values()), p.memory_bytes)


def candidates(spec: ModelSpec, workload: Workload, cluster: Cluster, *, zero_stages: tuple[int, ...] = (1, 2, 3),
               micro_batches: tuple[int, ...] = (1, 2, 4), cp_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
               recompute: tuple[Any, ...] | None = None, virtual_stages: tuple[int, ...] = (1, 2, 4),
               ep_sizes: tuple[int, ...] | None = None, **kw: Any) -> list[Plan]:
    """Every valid layout of `cluster.gpus` devices, ranked by `rank_key`.

    Valid: tp divides the heads and stays in a node; pp x v <= layers; dp x m x micro_batch = the
    global batch (pipelines spend batch: m >= pp; without a pipeline the m micro-batches are
    accumulated one after the other); cp only for sequences of 8k tokens or more, each rank keeping at
    least 2k of them; interleaving (v > 1) when m is a multiple of pp (Megatron-LM's rule).
    `recompute`: the modes to try; by default none and full, and selective when the attention scores
    are stored (`flash_attention=False`; with FlashAttention selective recomputation keeps the same bytes).
    A mixture of experts also walks ep: every divisor of dp that divides the experts (or those in `ep_sizes`).
    """
    if recompute is None:
        recompute = ("none", "full") if kw.get("flash_attention", True) else ("none", "selective", "full")
    out = []
    for mesh in meshes(spec, workload, cluster, cp_sizes, ep_sizes):
        tp, cp, pp, dp, ep, etp = (mesh[a] for a in ("tp", "cp", "pp", "dp", "ep", "etp"))
        for mb in micro_batches:
            if workload.global_batch % (dp * mb):
                continue
            m = workload.global_batch // (dp * mb)
            if pp > 1 and m < pp:
                continue          # a pipeline needs m >= pp micro-batches: it spends batch
            for v in [v for v in virtual_stages if v == 1 or (pp > 1 and m % pp == 0 and pp * v <= spec.n_layers)]:
                for zero in zero_stages if dp * cp > 1 else (0,):
                    for rc in recompute:
                        layout = Layout(dp, tp, pp, cp, zero, mb, m, "1f1b", rc, v, ep, 1 if etp < tp else 0)
                        out.append(plan(spec, layout, workload, cluster, **kw))
    return sorted(out, key=rank_key)


def assumptions(cluster: Cluster) -> list[str]:
    """What the estimates rest on, for this cluster: stated with every table the planner prints."""
    g, lat = cluster.gpu, cluster.latency
    eff = (f"{cluster.efficiency:.1%} of peak bf16 ({g.bf16_TFLOPs:g} TFLOP/s): "
           + (f"the measured matmul ceiling, {g.mamf_TFLOPs:g} TFLOP/s ({MAMF_SOURCE}), an upper bound"
              if cluster.kernel_efficiency is None and g.mamf_TFLOPs else "given"))
    nic = "this cluster's NICs" if cluster.nic_GBps is not None else f"one {g.ib_name} NIC per GPU"
    return [
        f"Kernels: {eff}. FLOPs per token: 6 per matrix weight + 12 L h s for attention (counted whole); "
        "MFU leaves recomputation out.",
        f"Links per GPU and direction: {g.nvlink_GBps:g} GB/s {g.nvlink_name} inside a node, "
        f"{cluster.ib_bytes_per_s / 1e9:g} GB/s between nodes ({nic}); mesh order pp, dp, ep, cp, tp (outermost first).",
        f"Collectives: bytes over the link plus NCCL's ring latency ({lat.base * 1e6:g} us per call, "
        f"{lat.intra * 1e6:g} us per NVLink hop, {lat.inter * 1e6:g} us per network hop; all-reduce: ring or "
        "tree, the faster). tp and cp wait on every micro-batch; ZeRO-0..2 buckets of "
        f"{BUCKET_BYTES / 2**20:g} MiB hide under the backward (2/3 of compute); ZeRO-3 prefetches one block: "
        "the first gather and whatever a block's compute cannot cover stay exposed.",
        "Schedules: 1F1B, or interleaved 1F1B with v chunks per rank, bubble ((p-1)/v)/(m + (p-1)/v). "
        "Activations: Korthikanti et al. (2022) with sequence parallelism, FlashAttention unless told; "
        "recomputation none, selective (the attention core) or full.",
        "Mixtures of experts: FLOPs count the active parameters (router and k of E experts); E/ep experts per "
        "device, each split over tp like a dense MLP or whole (etp=1: MoE Parallel Folding, ep innermost over "
        "tp x cp x dp, no tp collectives around the experts), their states ZeRO-sharded over their replicas; "
        "routing uniform unless told (plan's imbalance: the busiest ep rank's rows over the mean scale its "
        "experts' compute and the all-to-all bytes; default 1); per MoE block and micro-batch "
        "an all-to-all of counts and four of b s k h / (cp tp) bytes (dispatch and combine, forward and "
        "backward) on the critical path, each N - 1 sends (one latency per peer, a network hop for a peer in "
        "another node) at NVLink speed inside a node, else the NIC's for the share leaving the node.",
        "Not known to the planner: kernel efficiency at a run's own shapes, stragglers and slow links, "
        "failures and restarts, data loading, and overlap tricks beyond the above (tp communication overlap).",
    ]


def markdown(plans: list[Plan], cluster: Cluster | None = None) -> str:
    """A ranked table: memory per device, bytes per device per step by link, bubble, estimated step,
    and the frameworks that run the layout, followed by the assumptions the estimates rest on. The
    byte columns are algorithmic bytes (each call's size through the ring formula), not what a
    profiler would see on the wire."""
    lines = ["| # | layout | GB per device | fits | NVLink GB/step | IB GB/step | bubble | step (s, est.) | MFU (est.) | runs on |",
             "|---:|---|---:|:-:|---:|---:|---:|---:|---:|---|"]
    for i, p in enumerate(plans, 1):
        lb = p.link_bytes()
        lines.append(f"| {i} | {p.layout} | {p.memory_bytes / GB:.1f} | {'yes' if p.fits else 'no'} | "
                     f"{lb['nvlink'] / GB:.2f} | {lb['ib'] / GB:.2f} | {p.bubble:.2f} | {p.step_s:.2f} | "
                     f"{p.mfu:.0%} | {p.frameworks} |")
    lines.append("")
    lines.append("GB per device: model states + activations + logits, ZeRO-3's gathered units and fp32 gradient "
                 "accumulation, against the memory less headroom (CUDA context, NCCL buffers, fragmentation). "
                 "NVLink / IB: algorithmic bytes (each call's size through the ring formula) one device sends per step. "
                 "MFU (est.): the model's FLOPs (6 per weight a token uses + attention) over the devices' peak and the estimated "
                 "step: the kernels' efficiency less the bubble, exposed communication and recomputation.")
    lines.append("Model states per device are checked against simulation (`distlab.course.sim.check_recipes`: the "
                 "recipes 7B ZeRO-2 on 8, 13B ZeRO-3 on 16, 70B ZeRO-3 + TP 8 on 64 and 175B dp 8 x tp 8 x pp 16 + "
                 "ZeRO-3 on 1024, each run as rank 0 of its GPUs on fake tensors): within 5 % (tests/test_sim.py). "
                 "Activations and the step time are the model's alone.")
    c = cluster or next((p.cluster for p in plans if p.cluster is not None), None)
    if c is not None:
        lines.append("")
        lines.append("Assumptions: " + " ".join(assumptions(c)))
    return "\n".join(lines)
