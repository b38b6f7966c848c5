"""One layout's predictions: parameters, model states, activations and buffers per stage, bytes per group and
link, and the step time, term by term (each term's closed form lives in `distlab.theory`)."""
from __future__ import annotations

import math
from dataclasses import replace

from distlab.course.planner.layout import Cluster, Layout, Plan, Workload
from distlab.course.planner.shapes import ModelSpec
from distlab.theory import moe as mt
from distlab.theory import planning as pt
from distlab.theory.pipeline import activations_in_flight, bubble_fraction, dp_bytes

# The course's one mesh order, innermost first: a group stays in a node when its span fits. Expert
# parallelism sits between cp and dp: experts are carved out of the data-parallel ranks, so the ep ranks
# of one group are neighbours (in a node when tp x cp x ep <= 8), the replicas of one expert (dp/ep of
# them: the "edp" group) are ep ranks apart, and the dense parts' dp group spans both. Folded layouts
# (`Layout.etp` = 1, MoE Parallel Folding) lay the experts' own mesh ep x edp over tp x cp x dp, ep innermost.
AXES = ("tp", "cp", "ep", "dp", "pp")
BUCKET_BYTES = 25 * 2**20       # gradient bucket of ZeRO-0..2 (PyTorch DDP's bucket_cap_mb default)


def _stage_layers(spec: ModelSpec, pp: int) -> list[int]:
    from distlab.course.pipeline.stages import stage_layers
    return [b - a for a, b in stage_layers(spec.n_layers, pp)]


def block_params(spec: ModelSpec, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """One block's parameters on one tp rank. Column-parallel q, k, v and up (and gate): weights and biases
    split; row-parallel o and down: weights split, biases replicated; norms replicated. K and V are split
    when tp divides the key/value heads and replicated otherwise. A mixture of experts: E/ep experts
    (`expert_block_params`), each split over tp like the dense MLP (over `etp` when given: 1, experts
    whole); the router replicated."""
    d, kv, f = spec.d_model, spec.kv_dim, spec.ffn_dim
    up = (2 if spec.gated else 1) * f
    kv_split = spec.kv_heads % tp == 0
    mlp = 0 if spec.moe else up * d + f * d + (up if spec.bias else 0)
    split = 2 * d * d + mlp + (2 * d * kv if kv_split else 0)
    if spec.bias:
        split += d + (2 * kv if kv_split else 0)
    dense = spec.layer_params - spec.layer_expert_params
    return split // tp + dense - split + expert_block_params(spec, tp if etp is None else etp, ep)


def expert_block_params(spec: ModelSpec, tp: int, ep: int = 1) -> int:
    """One block's expert parameters on one device: E/ep experts, each one's up (and gate) weights and
    biases and down weights split over tp, its down bias replicated (0 for a dense model)."""
    if not spec.moe:
        return 0
    if spec.n_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {spec.n_experts} experts")
    d, f = spec.d_model, spec.ffn_dim
    up = (2 if spec.gated else 1) * f
    split = up * d + f * d + (up if spec.bias else 0)
    return spec.n_experts // ep * (split // tp + spec.expert_params - split)


def local_params(spec: ModelSpec, tp: int, pp: int, stage: int, *, vocab_parallel: bool = True, ep: int = 1,
                 etp: int | None = None) -> int:
    """Parameters one device of pipeline stage `stage` holds with tensor parallelism `tp` (and expert
    parallelism `ep`: E/ep experts per block)."""
    d = spec.d_model
    n = _stage_layers(spec, pp)[stage] * block_params(spec, tp, ep, etp)
    vocab = spec.vocab_size * d // (tp if vocab_parallel else 1)
    if stage == 0:
        n += vocab + spec.max_seq * d
    if stage == pp - 1:
        n += (vocab if not spec.tied or pp > 1 else 0) + pt.norm_params(d, spec.norm)
    return n


def _model_states(n: int, dp: int, zero: int, param_bytes: float, grad_bytes: float, k: float) -> float:
    shard = math.ceil(n / dp)
    return {0: (param_bytes + grad_bytes + k) * n, 1: (param_bytes + grad_bytes) * n + k * shard,
            2: param_bytes * n + (grad_bytes + k) * shard, 3: (param_bytes + grad_bytes + k) * shard}[zero]


def _groups(layout: Layout, gpus_per_node: int) -> dict[str, tuple[str, int]]:
    """Each group's link ("nvlink" or "ib") and the nodes it spans, by the mesh order `AXES`: tp, cp, ep,
    then "edp" (dp/ep: the replicas of one expert), pp; "dp" (the dense parts' data parallelism) spans ep
    and edp."""
    out, stride = {}, 1
    for group in AXES:
        size = layout.dp // layout.ep if group == "dp" else getattr(layout, group)
        nodes = pt.group_nodes(size, stride, gpus_per_node)
        out["edp" if group == "dp" else group] = ("nvlink" if nodes == 1 else "ib", nodes)
        stride *= size
    nodes = pt.group_nodes(layout.dp, layout.tp * layout.cp, gpus_per_node)
    out["dp"] = ("nvlink" if nodes == 1 else "ib", nodes)
    if layout.folded:                       # experts' mesh etp (1) x ep x edp over the same ranks, ep innermost
        for group, size, stride in (("ep", layout.ep, 1), ("edp", layout.edp * layout.cp, layout.ep)):
            nodes = pt.group_nodes(size, stride, gpus_per_node)
            out[group] = ("nvlink" if nodes == 1 else "ib", nodes)
    return out


def plan(spec: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster | None = None, *,
         param_bytes: float = 2, grad_bytes: float = 2, k: float = 12, act_bytes: float = 2,
         vocab_parallel: bool = True, flash_attention: bool = True, accum_bytes: float = 4,
         sequence_parallel: bool | None = None, imbalance: float = 1.0) -> Plan:
    """Predictions for one layout (per pipeline stage, for one device of that stage).

    `act_bytes`: bytes per activation element (2 for bf16). `flash_attention`: the attention scores are
    never stored (FlashAttention), dropping Korthikanti's 5as/h term. `accum_bytes`: bytes per element of
    the buffer gradients accumulate in over m micro-batches (4: fp32, as Megatron's main gradients; 2
    accumulates in the 16-bit gradient itself, as the chapter's own ZeRO-1 does). `sequence_parallel`
    (Korthikanti et al. 2022): activations outside the tp regions are split over tp too, and so is the
    tensor a stage sends to the next (Megatron's scatter/gather of Narayanan et al. 2021, 4.1): pp bytes
    / tp. None: as `vocab_parallel`, i.e. on for Megatron-style tp (the default) and off for the chapter's
    own 3-D code, which has neither.

    Besides model states and block activations, `buffers` holds per stage: "logits" (the last stage's
    logits in 16 bits, their fp32 upcast and gradient for one micro-batch, and the fp32 softmax saved for
    each micro-batch in flight), "gathered" (ZeRO-3: the unit in use and the next one prefetched),
    "fp32 grads" (accumulation beyond the 16-bit gradient). Traffic is algorithmic bytes: each call's
    size through the ring formula. `times` splits the estimated step into its terms (`step_terms`).

    A mixture of experts (`spec.moe`) adds two groups to `traffic` and `links` (and "ep" to `times`): "ep",
    per MoE block and micro-batch an all-to-all of counts (E - E/ep int64) and four all-to-alls of the
    device's tokens (b s / cp, / tp with sequence parallelism) x k rows of h (dispatch and combine, forward
    and backward), each T k h e (ep-1)/ep (`distlab.theory.moe`); "edp", the experts' gradients over their
    dp/ep replicas (x cp), while "dp" carries the dense parts'. Routing is taken as uniform (no drops)
    unless `imbalance` > 1: the busiest ep rank's rows over a balanced rank's (chapter 10 measures it,
    `distlab.course.moe.measure`), which scales its experts' compute and the all-to-all bytes it receives
    (with ep = 1 every device runs all experts on its own tokens: nothing to wait for).
    """
    if imbalance < 1:
        raise ValueError(f"imbalance is the busiest rank's load over the mean, >= 1; got {imbalance}")
    L = layout
    if sequence_parallel is None:
        sequence_parallel = vocab_parallel
    if L.pp * L.v > spec.n_layers:
        raise ValueError(f"{L.pp} pipeline stages of {L.v} chunks for {spec.n_layers} layers")
    if spec.n_heads % L.tp:
        raise ValueError(f"tp={L.tp} does not divide the {spec.n_heads} heads")
    if L.ep > 1 and not spec.moe:
        raise ValueError(f"ep={L.ep} needs a mixture of experts; {spec.name or 'this model'} is dense")
    stages = range(L.pp)
    layers = _stage_layers(spec, L.pp)
    n_local = [local_params(spec, L.tp, L.pp, r, vocab_parallel=vocab_parallel, ep=L.ep, etp=L.expert_tp)
               for r in stages]
    n_exp = [layers[r] * expert_block_params(spec, L.expert_tp, L.ep) for r in stages]  # of n_local: sharded over edp
    edp = L.edp
    states = [_model_states(n - e, L.dp, L.zero, param_bytes, grad_bytes, k)
              + _model_states(e, edp, L.zero, param_bytes, grad_bytes, k) for n, e in zip(n_local, n_exp)]
    per_layer = pt.activation_bytes_per_layer(
        workload.seq_len / L.cp, L.micro_batch, spec.d_model, n_heads=spec.n_heads, kv=spec.kv_dim,
        ffn=spec.ffn_dim, gated=spec.gated, dropout=spec.dropout, tp=L.tp, flash=flash_attention,
        recompute=L.recompute, act_bytes=act_bytes, sp=sequence_parallel, n_experts=spec.n_experts,
        top_k=spec.top_k)
    in_flight = [activations_in_flight(L.schedule, L.pp, L.m, r, L.v) for r in stages]
    acts = [in_flight[r] * layers[r] * per_layer for r in stages]
    elems = L.micro_batch * (workload.seq_len / L.cp) * spec.d_model      # one activation b s h
    tokens_mb = L.micro_batch * workload.seq_len / L.cp                  # b s of one micro-batch
    ring = 2 * (L.tp - 1) / L.tp
    vp = vocab_parallel and L.tp > 1

    def tp_calls(r: int) -> tuple[float, int]:
        """Bytes of one micro-batch's tp all-reduces on stage r (each call's size), and how many calls."""
        per = 2 if L.folded and spec.moe else 4     # folded: whole experts on local tokens, no tp around the MLP
        size, calls = per * layers[r] * elems * act_bytes, per * layers[r]  # f and g around attention and MLP
        if vp and r == 0:
            size, calls = size + elems * act_bytes, calls + 1               # the vocabulary-parallel embedding's g
        if vp and r == L.pp - 1:
            size += elems * act_bytes + 3 * tokens_mb * 4                   # the head's f; cross-entropy's 3 (fp32)
            calls += 4
        return size, calls

    # Interleaving: a micro-batch crosses every chunk boundary, v per rank and direction (the last chunk of
    # the last stage sends nothing forward, the first chunk of the first stage nothing back).
    sends = [(L.v - (r == L.pp - 1)) + (L.v - (r == 0)) if L.pp > 1 else 0 for r in stages]
    traffic = {
        # the dense parts' gradients (the experts' go over "edp"); cp shares dp's gradients
        "dp": [dp_bytes(n - e, L.dp * L.cp, L.zero, grad_bytes, L.m) for n, e in zip(n_local, n_exp)],
        "tp": [L.m * tp_calls(r)[0] * ring for r in stages],
        "pp": [L.m * sends[r] * elems * act_bytes / (L.tp if sequence_parallel else 1) for r in stages],
        # Ring attention passes K and V around the cp ring: forward once, backward twice.
        # Ring attention passes K and V (b s kv each: a GQA model's are narrower) around the cp ring:
        # forward once, backward twice; split over tp with the heads.
        "cp": [L.m * layers[r] * 3 * 2 * elems * spec.kv_dim / spec.d_model * act_bytes * (L.cp - 1)
               / (L.tp if spec.kv_heads % L.tp == 0 else 1) for r in stages],
    }
    # Each device routes its own tokens: b s / cp, and / tp with sequence parallelism (Megatron's
    # dispatcher then gathers them over tp for the tp-split experts: the tp collectives already counted).
    tokens_dev = tokens_mb / (L.tp if sequence_parallel else 1)
    a2a = tokens_dev * spec.top_k * spec.d_model * act_bytes        # one all-to-all's send buffer
    if spec.moe:
        per_layer_ep = (4 * mt.uniform_a2a_bytes(tokens_dev, spec.top_k, spec.d_model, L.ep, act_bytes)
                        + (mt.counts_bytes(spec.n_experts, L.ep) if L.ep > 1 else 0))
        traffic["ep"] = [L.m * layers[r] * per_layer_ep for r in stages]
        traffic["edp"] = [dp_bytes(e, edp * L.cp, L.zero, grad_bytes, L.m) for e in n_exp]
    vocab_local = spec.vocab_size / (L.tp if vp else 1)
    last = L.pp - 1
    logits = [0.0] * L.pp
    logits[last] = tokens_mb * vocab_local * ((act_bytes + 4 + 4) + 4 * (in_flight[last] - 1))
    unit = max(block_params(spec, L.tp, L.ep, L.expert_tp),
               spec.vocab_size * spec.d_model // (L.tp if vocab_parallel else 1))
    gathered = [2 * unit * param_bytes if L.zero == 3 else 0.0 for _ in stages]
    accum = [(accum_bytes - grad_bytes) * (n if L.zero < 2 else math.ceil((n - e) / L.dp) + math.ceil(e / edp))
             if L.m > 1 else 0.0 for n, e in zip(n_local, n_exp)]
    buffers = {"logits": logits, "gathered": gathered, "fp32 grads": [max(0.0, a) for a in accum]}
    c = cluster or Cluster(gpus=L.gpus)
    groups = _groups(L, c.gpu.gpus_per_node)
    links = {g: link for g, (link, _) in groups.items() if g in traffic}
    times = step_terms(spec, L, workload, c, traffic, groups, layers, [tp_calls(r)[1] for r in stages], sends,
                       n_local, param_bytes, grad_bytes, n_exp, a2a, imbalance)
    step = sum(times.values())
    tokens = workload.global_batch * workload.seq_len
    mfu = tokens * spec.flops_per_token(workload.seq_len) / (L.gpus * c.gpu.bf16_TFLOPs * 1e12 * step)
    bub = bubble_fraction(L.pp, L.m, L.v) if L.pp > 1 else 0.0
    p = Plan(L, n_local, states, acts, traffic, links, bub, step, buffers=buffers, mfu=mfu, times=times,
             cluster=c)
    return replace(p, fits=p.memory_bytes <= c.usable_bytes)


def step_terms(spec: ModelSpec, L: Layout, workload: Workload, c: Cluster, traffic: dict[str, list[float]],
               groups: dict[str, tuple[str, int]], layers: list[int], tp_calls: list[int], sends: list[int],
               n_local: list[int], param_bytes: float, grad_bytes: float, n_exp: list[int] | None = None,
               a2a_bytes: float = 0.0, imbalance: float = 1.0) -> dict[str, float]:
    """The estimated step, term by term (seconds; their sum is the step):

    compute   the model's FLOPs and recomputation's, at the kernels' efficiency (`Cluster.efficiency`);
    tp, cp    their collectives, on the critical path of every micro-batch: bytes over the link plus one
              latency per call (`theory.planning.collective_s`);
    bubble    the pipeline's idle share of compute, tp and cp: (p - 1)/v over m + (p - 1)/v;
    pp        point-to-point messages: bytes plus a latency per message;
    dp        ZeRO-0..2: the gradient exchange (bytes plus a latency per bucket) beyond what the backward
              (two thirds of compute) hides; ZeRO-3: what each micro-batch's gathers and reduce-scatters
              cannot hide (`theory.planning.zero3_exposed_s`), with one unit per block. A mixture of
              experts: the dense parts over dp, the experts (`n_exp` per device) over their dp/ep replicas.
    ep        (a mixture of experts only) per MoE block and micro-batch, an all-to-all of counts and four of
              `a2a_bytes` each (dispatch and combine, forward and backward), on the critical path like tp:
              `theory.planning.collective_s("all_to_all", ...)`, over NVLink when the ep group is in a
              node, else over the cluster's NICs with a network hop per peer in another node.
    """
    n_exp = n_exp or [0] * L.pp
    peak = c.gpu.bf16_TFLOPs * 1e12 * c.efficiency
    bw = {"nvlink": c.gpu.nvlink_GBps * 1e9, "ib": c.ib_bytes_per_s}
    s, tokens = workload.seq_len, workload.global_batch * workload.seq_len
    blocks = spec.n_layers * spec.layer_matmul_params
    extra = pt.recompute_flops_per_token(L.recompute, blocks, spec.n_layers, spec.d_model, s)
    compute = tokens * (spec.flops_per_token(s) + extra) / (L.gpus * peak)
    skew = imbalance - 1 if spec.moe and L.ep > 1 else 0.0
    if skew:            # the busiest rank's experts run imbalance x a balanced rank's rows (and recompute them)
        experts = spec.n_layers * spec.top_k * pt.expert_params(spec.d_model, spec.ffn_dim, gated=spec.gated,
                                                                 bias=False)
        compute += tokens * (6 + (2 if L.recompute == "full" else 0)) * experts * skew / (L.gpus * peak)
    lat = c.latency

    def link(g: str) -> tuple[float, int]:
        kind, nodes = groups[g]
        return bw[kind], nodes

    def exposed(g: str, calls: list[int], op: str, size: int) -> float:
        b, nodes = link(g)
        alpha = pt.collective_s(op, 0.0, size, b, nodes, lat) if size > 1 else 0.0
        return max(traffic[g][r] / b + L.m * calls[r] * alpha for r in range(L.pp))

    tp = exposed("tp", tp_calls, "all_reduce", L.tp)
    cp = exposed("cp", [3 * (L.cp - 1) * n for n in layers], "send", L.cp) if L.cp > 1 else 0.0
    pp = exposed("pp", sends, "send", 2) if L.pp > 1 else 0.0
    ep = 0.0
    if spec.moe and L.ep > 1:
        b, nodes = link("ep")
        one = 4 * pt.collective_s("all_to_all", a2a_bytes * (1 + skew), L.ep, b, nodes, lat) + pt.collective_s(
            "all_to_all", spec.n_experts * 8, L.ep, b, nodes, lat)              # four payloads and the counts
        ep = L.m * max(layers) * one
    bub = bubble_fraction(L.pp, L.m, L.v) if L.pp > 1 else 0.0
    busy = compute + tp + cp + ep
    gpn = c.gpu.gpus_per_node
    n_dp = L.dp * L.cp                                   # cp ranks share dp's gradients and gathers
    b_dp, nodes_dp = link("dp")
    if L.cp > 1:
        nodes_dp = pt.group_nodes(n_dp, L.tp, gpn)
        b_dp = bw["nvlink" if nodes_dp == 1 else "ib"]
    n_edp = L.edp * L.cp                                 # the replicas of one expert
    b_edp, nodes_edp = link("edp")
    if L.cp > 1 and not L.folded:
        nodes_edp = min(n_edp, nodes_edp * pt.group_nodes(L.cp, L.tp, gpn))
        b_edp = bw["nvlink" if nodes_edp == 1 else "ib"]
    dense = [n - e for n, e in zip(n_local, n_exp)]
    if n_dp == 1:
        dp = 0.0
    elif L.zero == 3:
        unit_e = expert_block_params(spec, L.expert_tp, L.ep)
        unit = block_params(spec, L.tp, L.ep, L.expert_tp) - unit_e
        gather = pt.collective_s("all_gather", unit * param_bytes, n_dp, b_dp, nodes_dp, lat)
        scatter = pt.collective_s("reduce_scatter", unit * grad_bytes, n_dp, b_dp, nodes_dp, lat)
        if spec.moe:                                   # the experts' shards, over their own replicas
            gather += pt.collective_s("all_gather", unit_e * param_bytes, n_edp, b_edp, nodes_edp, lat)
            scatter += pt.collective_s("reduce_scatter", unit_e * grad_bytes, n_edp, b_edp, nodes_edp, lat)
        block = compute / (L.m * max(layers))          # one block's share of one micro-batch on this device
        fwd = block / (4 if L.recompute == "full" else 3)
        back = block - fwd                              # backward (and the recomputed forward)
        dp = L.m * max(pt.zero3_exposed_s(n, gather, scatter, fwd, back) for n in layers)
    else:
        calls = {0: 1, 1: 2, 2: L.m + 1}[L.zero]
        buckets = max(math.ceil(n * grad_bytes / BUCKET_BYTES) for n in dense)
        alphas = buckets * pt.collective_s("reduce_scatter", 0.0, n_dp, b_dp, nodes_dp, lat)
        wire = [traffic["dp"][r] / b_dp for r in range(L.pp)]
        if spec.moe and n_edp > 1:                   # the experts' buckets, over their own replicas
            buckets_e = max(math.ceil(e * grad_bytes / BUCKET_BYTES) for e in n_exp)
            alphas += buckets_e * pt.collective_s("reduce_scatter", 0.0, n_edp, b_edp, nodes_edp, lat)
            wire = [w + traffic["edp"][r] / b_edp for r, w in enumerate(wire)]
        dp = max(0.0, max(wire) + calls * alphas - compute * 2 / 3)
    times = {"compute": compute, "bubble": busy * bub / (1 - bub), "tp": tp, "cp": cp, "pp": pp, "dp": dp}
    if spec.moe:
        times = {**dict(list(times.items())[:4]), "ep": ep, "pp": pp, "dp": dp}
    return times
