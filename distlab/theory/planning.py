"""Closed forms chapter 8's layout planner adds to `pipeline`: model shapes beyond GPT, FLOPs per token
with attention, activations under selective recomputation, collectives with a latency term, ZeRO-3's
gathers that cannot hide, and a cluster's NIC bandwidth per GPU. Pure functions, no ranks.

    layer_params(16384, 128, 8, 53248, gated=True, bias=False, norm="rmsnorm")   # one Llama 3 405B block
    model_flops_per_token(matmul_params=405e9, n_layers=126, d_attn=16384, seq_len=8192)  # 6 Psi + 12 L h s
    activation_bytes_per_layer(2048, 1, 12288, n_heads=96, tp=8, flash=False)   # Korthikanti: sbh(34 + 5as/h)/t
    ring_latency_s("all_gather", 2048, 256)        # NCCL's ring: one hop per rank, network hops slower
    collective_s("all_to_all", 64e6, 8, 450e9)     # expert parallelism's dispatch: N - 1 sends
    zero3_exposed_s(units=16, gather_s=0.02, scatter_s=0.02, forward_s=0.01, backward_s=0.02)

Names: d = d_model (h in Korthikanti et al.), a = query heads, f = the MLP's hidden width, s = sequence
(per rank), b = micro-batch, t = tp, L = layers, Psi = parameters; mixtures of experts (chapter 10): E experts
of width f per block, k of them per token, a router of d x E.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# ---- shapes --------------------------------------------------------------------------------------------


def kv_dim(d: int, n_heads: int, n_kv_heads: int) -> int:
    """Width of K (and of V) with grouped-query attention: n_kv_heads heads of d / n_heads each."""
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_kv_heads} key/value heads do not divide the {n_heads} query heads")
    return d // n_heads * n_kv_heads


def layer_matmul_params(d: int, n_heads: int, n_kv_heads: int, ffn: int, *, gated: bool, n_experts: int = 0,
                        top_k: int = 1) -> int:
    """Weights of one block's matrices that a token goes through: q and o (d x d each), k and v (d x kv
    each), and the MLP: 2 d f (up, down) or 3 d f with a gated unit (SwiGLU: gate, up, down). A mixture of
    experts (`n_experts` > 1) replaces the MLP by a router (d x E) and E experts of width f, of which a
    token uses `top_k`: the *active* weights, what FLOPs per token count."""
    kv = kv_dim(d, n_heads, n_kv_heads)
    mlp = (3 if gated else 2) * d * ffn
    if n_experts > 1:
        mlp = d * n_experts + top_k * mlp
    return 2 * d * d + 2 * d * kv + mlp


def expert_params(d: int, ffn: int, *, gated: bool = False, bias: bool = True) -> int:
    """One expert (an MLP of width f): 2 d f or 3 d f weights, and biases f (or 2 f) + d.
    The course's expert (GeLU, biases): 2 d f + f + d, as `distlab.theory.moe.expert_params`."""
    up = (2 if gated else 1) * ffn
    return (up + ffn) * d + ((up + d) if bias else 0)


def layer_params(d: int, n_heads: int, n_kv_heads: int, ffn: int, *, gated: bool = False, bias: bool = True,
                 norm: str = "layernorm", n_experts: int = 0) -> int:
    """All of one block's parameters: matrices, biases (q, k, v, o; the MLP's up/gate and down) and two norms
    (LayerNorm: weight and bias, 2d; RMSNorm: weight, d). GPT (kv = d, f = 4d, biases, LayerNorm): 12d^2 + 13d.
    A mixture of experts (`n_experts` > 1): the MLP is replaced by a router (d x E, no bias) and E experts
    (`expert_params`): Mixtral 8x7B's block, 2 d^2 + 2 d kv + 8 d + 8 x 3 d f + 2 d = 1.45B."""
    kv = kv_dim(d, n_heads, n_kv_heads)
    attn = 2 * d * d + 2 * d * kv + ((d + 2 * kv + d) if bias else 0)
    if n_experts > 1:
        mlp = d * n_experts + n_experts * expert_params(d, ffn, gated=gated, bias=bias)
    else:
        mlp = expert_params(d, ffn, gated=gated, bias=bias)
    return attn + mlp + 2 * norm_params(d, norm)


def norm_params(d: int, norm: str = "layernorm") -> int:
    if norm not in ("layernorm", "rmsnorm"):
        raise ValueError(f"unknown norm {norm!r}; choose layernorm or rmsnorm")
    return 2 * d if norm == "layernorm" else d


# ---- FLOPs per token ---------------------------------------------------------------------------------


def attention_flops_per_token(n_layers: int, d_attn: int, seq_len: int) -> float:
    """Forward and backward of the attention scores and their product with V, per token: 12 L h s.

    Per layer and sequence the forward computes QK^T and AV, 2 s^2 h each (4 s^2 h), the backward twice
    that: 12 s^2 h per sequence, 12 s h per token. Counted whole, as Narayanan et al. (2021), Korthikanti et
    al. (2022) and PaLM's MFU do, although a causal kernel skips about half. It passes 6 Psi per token when
    s > Psi / (2 L h), e.g. 128k tokens for a 405B model with L = 126, h = 16384: 12 L h s = 3.2e12 vs 2.4e12.
    """
    return 12.0 * n_layers * d_attn * seq_len


def model_flops_per_token(matmul_params: float, n_layers: int, d_attn: int, seq_len: int) -> float:
    """The model's own FLOPs per trained token: 6 per matrix weight (forward 2, backward 4) plus attention.
    `matmul_params`: every weight a matrix product uses (the blocks' matrices and the head; not the input
    embedding, a lookup). This is what MFU divides by; recomputation is not counted."""
    return 6.0 * matmul_params + attention_flops_per_token(n_layers, d_attn, seq_len)


def recompute_flops_per_token(mode: str, matmul_params: float, n_layers: int, d_attn: int, seq_len: int) -> float:
    """Extra FLOPs per token that recomputation costs: "full" reruns each block's forward (a third of the
    blocks' FLOPs: 2 per weight + 4 L h s), "selective" (Korthikanti et al. 2022) only the attention core
    (QK^T, softmax, AV: 4 L h s), "none" nothing. `matmul_params`: the blocks' matrix weights (the head is
    not recomputed)."""
    if mode == "none":
        return 0.0
    core = attention_flops_per_token(n_layers, d_attn, seq_len) / 3
    if mode == "selective":
        return core
    if mode == "full":
        return 2.0 * matmul_params + core
    raise ValueError(f"unknown recomputation {mode!r}; choose none, selective or full")


# ---- activations -------------------------------------------------------------------------------------


def activation_bytes_per_layer(s: float, b: int, d: int, *, n_heads: int, kv: int | None = None,
                               ffn: int | None = None, gated: bool = False, dropout: bool = True, tp: int = 1,
                               flash: bool = True, recompute: str = "none", act_bytes: float = 2,
                               sp: bool = True, n_experts: int = 0, top_k: int = 1) -> float:
    """Bytes one block keeps for its backward, per device, with tensor and sequence parallelism over `tp`.

    Korthikanti et al. (2022), Table 2, generalised to GQA (kv = width of K and V) and gated MLPs; each
    tensor is named by the product that needs it (e = `act_bytes`, masks 1 byte per element):
      attention: QKV input e sbh, Q e sbh, K and V e sb kv each, output projection input e sbh, dropout mask sbh;
                 scores (softmax output e, dropout mask 1, dropout output e): a s^2 b (2e + 1) unless `flash`
                 (FlashAttention keeps none: it recomputes them in its backward);
      MLP:       input e sbh, then GeLU input and output e sbf each, or SwiGLU's gate and up outputs (2 e sbf)
                 and the down projection's input e sbf; dropout mask sbh;
      norms:     each one's input, 2 e sbh.
    GPT (kv = h, f = 4h, dropout, e = 2): sbh(34 + 5as/h), all over t with sequence parallelism (`sp`);
    without it the norms' inputs, the dropout masks and the inputs of QKV and of the MLP stay whole on every
    tp rank: sbh(10 + 24/t + 5as/(ht)).
    A mixture of experts (`n_experts` > 1, `top_k` = k, f the expert's width): the MLP keeps its input and
    mask, the router's fp32 probabilities (4 sbE), and for each of a token's k experts its permuted input row
    and the expert's inner tensors: e sb(h + k(h + 3f)) gated (k(h + 2f) GeLU), with uniform routing and no
    drops, split over tp like the dense MLP.
    `recompute`: "selective" drops the scores (recomputed from Q and K): 34 sbh/t for GPT, the same as
    FlashAttention; "full" keeps only each block's input, e sbh (/t with sp).
    """
    kv = d if kv is None else kv
    f = 4 * d if ffn is None else ffn
    mask = 1.0 if dropout else 0.0
    if recompute == "full":
        return act_bytes * s * b * d / (tp if sp else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"unknown recomputation {recompute!r}; choose none, selective or full")
    attn = s * b * (act_bytes * (3 * d + 2 * kv) + mask * d)
    mlp = s * b * (act_bytes * d + act_bytes * (3 if gated else 2) * f + mask * d)
    if n_experts > 1:
        mlp = s * b * (act_bytes * d + top_k * act_bytes * (d + (3 if gated else 2) * f) + mask * d + 4 * n_experts)
    norms = 2 * act_bytes * s * b * d
    scores = 0.0 if flash or recompute == "selective" else n_heads * s * s * b * (2 * act_bytes + mask)
    whole = 0.0 if sp else s * b * d * (2 * act_bytes + 2 * mask + 2 * act_bytes)   # norms, masks, two inputs
    return (attn + mlp + norms + scores - whole) / tp + whole


# ---- collectives with a latency term ----------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    """Per-step latencies of a ring collective, in seconds (NCCL's own cost model, ring algorithm, Simple
    protocol): `base` once per call, `intra` per hop inside a node, `inter` per hop between nodes."""

    base: float
    intra: float
    inter: float


# NVIDIA/nccl src/graph/tuning.cc (2.1x, commit 01afd20): baseLat ring/Simple 8.4 us; hwLat ring/Simple
# NVLink 3.4 us, network 9.6 us per step (tree/Simple network: 50 us per level).
NCCL_RING = Latency(base=8.4e-6, intra=3.4e-6, inter=9.6e-6)
NCCL_TREE_INTER = 50e-6


def ring_latency_s(op: str, n_ranks: int, n_nodes: int = 1, latency: Latency = NCCL_RING) -> float:
    """Latency of one ring collective over `n_ranks` ranks in `n_nodes` nodes: base + one step per rank,
    (nodes - 1) of them between nodes (NCCL's model): alpha N, growing with the ring's size.
    All-gather and reduce-scatter take N - 1 steps, all-reduce 2(N - 1), send/recv one."""
    if n_ranks <= 1:
        return 0.0
    if not 1 <= n_nodes <= n_ranks:
        raise ValueError(f"n_nodes must be in 1..{n_ranks}, got {n_nodes}")
    times = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    if op == "send":
        return latency.base + (latency.inter if n_nodes > 1 else latency.intra)
    if op not in times:
        raise ValueError(f"no ring latency for {op!r}; known: {sorted(times)} and send")
    steps, inter = times[op] * (n_ranks - 1), times[op] * (n_nodes - 1)
    return latency.base + (steps - inter) * latency.intra + inter * latency.inter


def tree_latency_s(n_ranks: int, n_nodes: int = 1, latency: Latency = NCCL_RING,
                   inter: float = NCCL_TREE_INTER) -> float:
    """Latency of a tree all-reduce (NCCL): up and down, (ranks per node - 1) hops inside each node and
    log2(nodes) levels between them: alpha log N."""
    if n_ranks <= 1:
        return 0.0
    per_node = max(1, n_ranks // n_nodes)
    return latency.base + 2 * ((per_node - 1) * latency.intra + math.ceil(math.log2(n_nodes)) * inter)


def all_to_all_latency_s(n_ranks: int, n_nodes: int = 1, latency: Latency = NCCL_RING) -> float:
    """Latency of one all-to-all over `n_ranks` ranks in `n_nodes` nodes: NCCL runs it as N - 1 sends
    (one to each peer, grouped), counted here one after the other: base + (N/nodes - 1) hops inside the
    node + (N - N/nodes) network hops. Pessimistic where the sends overlap; alpha N, like a ring."""
    if n_ranks <= 1:
        return 0.0
    if not 1 <= n_nodes <= n_ranks:
        raise ValueError(f"n_nodes must be in 1..{n_ranks}, got {n_nodes}")
    local = n_ranks / n_nodes
    return latency.base + (local - 1) * latency.intra + (n_ranks - local) * latency.inter


def all_to_all_wire_bytes(message_bytes: float, n_ranks: int, n_nodes: int = 1) -> float:
    """Bytes of one rank's all-to-all on its slowest link, for a send buffer of S bytes split evenly over
    the N ranks (its own share stays): S (N-1)/N inside one node; across nodes the share for other nodes,
    S (N - N/nodes)/N, through the NIC (the share for its own node's peers goes over NVLink at the same
    time, 9-20x faster, and is not counted)."""
    if n_ranks <= 1:
        return 0.0
    if n_nodes <= 1:
        return message_bytes * (n_ranks - 1) / n_ranks
    return message_bytes * (n_ranks - n_ranks / n_nodes) / n_ranks


def collective_s(op: str, message_bytes: float, n_ranks: int, bandwidth: float, n_nodes: int = 1,
                 latency: Latency = NCCL_RING) -> float:
    """alpha-beta time of one collective on a message of S bytes (the gathered output, the scattered input,
    the all-reduced buffer, an all-to-all's send buffer): latency (all-reduce: the smaller of ring and tree,
    as NCCL picks) plus the bytes one rank sends, S (N-1)/N (all-reduce: twice), over `bandwidth` bytes/s.
    "all_to_all": N - 1 sends (`all_to_all_latency_s`) and `all_to_all_wire_bytes`; `bandwidth` is the
    NIC's when the ranks span nodes."""
    if n_ranks <= 1:
        return 0.0
    if op == "all_to_all":
        return (all_to_all_latency_s(n_ranks, n_nodes, latency)
                + all_to_all_wire_bytes(message_bytes, n_ranks, n_nodes) / bandwidth)
    share = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}.get(op)
    if op == "send":
        return ring_latency_s("send", 2, min(n_nodes, 2), latency) + message_bytes / bandwidth
    if share is None:
        raise ValueError(f"no cost model for {op!r}")
    alpha = ring_latency_s(op, n_ranks, n_nodes, latency)
    if op == "all_reduce":
        alpha = min(alpha, tree_latency_s(n_ranks, n_nodes, latency))
    return alpha + share * message_bytes * (n_ranks - 1) / n_ranks / bandwidth


def group_nodes(size: int, stride: int, gpus_per_node: int = 8) -> int:
    """Nodes a group of `size` ranks spans when its members are `stride` ranks apart (the product of the
    sizes of the axes inside it in the mesh order)."""
    span = size * stride
    if span <= gpus_per_node:
        return 1
    if stride >= gpus_per_node:
        return size
    return span // gpus_per_node


# ---- ZeRO-3: what a unit's gather cannot hide --------------------------------------------------------


def zero3_exposed_s(units: int, gather_s: float, scatter_s: float, forward_s: float, backward_s: float) -> float:
    """Seconds of one micro-batch's ZeRO-3 communication that no compute hides, for `units` equal units
    gathered one after the other with one prefetched (each collective's time from `collective_s`).

    Forward: the first unit's gather waits with nothing to overlap; each next gather hides under the previous
    unit's forward, exposing max(0, gather - forward). Backward: the same for the first gather, then each next
    unit's gather and the previous unit's reduce-scatter share the link under one unit's backward,
    max(0, gather + scatter - backward); the last reduce-scatter has nothing after it.
    """
    if units < 1:
        return 0.0
    fwd = gather_s + (units - 1) * max(0.0, gather_s - forward_s)
    bwd = gather_s + (units - 1) * max(0.0, gather_s + scatter_s - backward_s) + scatter_s
    return fwd + bwd


# ---- the cluster's network ---------------------------------------------------------------------------


def nic_GBps_per_gpu(nics_per_node: int, gbit_per_nic: float, gpus_per_node: int = 8) -> float:
    """Inter-node bandwidth per GPU and direction in GB/s: the node's NICs shared by its GPUs.
    DGX A100 (8 x 200 Gb/s HDR): 25; Jean Zay's A100 nodes (4 x 100 Gb/s Omni-Path): 6.25; Llama 3's H100
    nodes (8 x 400 Gb/s RoCE): 50."""
    if min(nics_per_node, gpus_per_node) < 1 or gbit_per_nic <= 0:
        raise ValueError("nics_per_node, gpus_per_node >= 1 and gbit_per_nic > 0 are required")
    return nics_per_node * gbit_per_nic / 8 / gpus_per_node
