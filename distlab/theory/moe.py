"""Closed forms of chapter 10: mixture of experts and expert parallelism. Pure functions, no ranks.

Names: E experts, k experts per token, T tokens on a rank, h = `d_model`, e bytes per element, ep the
expert-parallel degree (E/ep experts per rank; expert x lives on rank x // (E/ep)), dp the data-parallel
degree of the dense parts.

Traffic of one MoE layer's forward on rank r, with M[i][j] the (token, choice) rows rank i sends to rank j:

- dispatch: an all-to-all of counts (every rank tells every other how many rows it sends to each of
  their experts: E - E/ep integers leave the rank), then `all_to_all_single` with uneven splits, which
  sends sum_{j != r} M[r][j] rows of h numbers;
- combine: the reverse `all_to_all_single`: rank r sends back what it received, sum_{j != r} M[j][r] rows.

Backward runs the same two payload all-to-alls in the other direction (the counts are reused). With
uniform routing and no drops, M[r][j] = T k / ep, so each payload all-to-all sends T k h e (ep-1)/ep.
"""
from __future__ import annotations

import math
from typing import Sequence

COUNT_BYTES = 8      # the counts travel as int64


def capacity(tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(cf x T x k / E) (GShard, Switch)."""
    return math.ceil(capacity_factor * tokens * k / n_experts)


def owner(expert: int, n_experts: int, ep: int) -> int:
    """The rank of the ep group that holds `expert` (contiguous blocks of E/ep experts)."""
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split over ep = {ep} ranks")
    return expert // (n_experts // ep)


def send_matrix(counts: Sequence[Sequence[int]], ep: int) -> list[list[int]]:
    """M[i][j]: rows rank i sends to rank j, from counts[i][x] = rank i's kept rows for expert x."""
    n_experts = len(counts[0])
    m = [[0] * ep for _ in range(ep)]
    for i, row in enumerate(counts):
        for x, c in enumerate(row):
            m[i][owner(x, n_experts, ep)] += int(c)
    return m


def counts_bytes(n_experts: int, ep: int) -> int:
    """Bytes rank r sends in the all-to-all of counts: one int64 per expert held elsewhere."""
    return (n_experts - n_experts // ep) * COUNT_BYTES


def dispatch_bytes(m: Sequence[Sequence[int]], rank: int, d_model: int, bytes_per_element: int = 4) -> int:
    """Payload bytes rank `rank` sends in the dispatch all-to-all: its rows for other ranks' experts."""
    return sum(c for j, c in enumerate(m[rank]) if j != rank) * d_model * bytes_per_element


def combine_bytes(m: Sequence[Sequence[int]], rank: int, d_model: int, bytes_per_element: int = 4) -> int:
    """Payload bytes rank `rank` sends in the combine all-to-all: the results of the rows it received."""
    return sum(row[rank] for j, row in enumerate(m) if j != rank) * d_model * bytes_per_element


def uniform_a2a_bytes(tokens: int, k: int, d_model: int, ep: int, bytes_per_element: int = 4) -> float:
    """One payload all-to-all under uniform routing without drops: T k h e (ep-1)/ep."""
    return tokens * k * d_model * bytes_per_element * (ep - 1) / ep


def expert_params(d_model: int, d_ff: int) -> int:
    """One expert (the course MLP with biases): 2 h d_ff + d_ff + h."""
    return 2 * d_model * d_ff + d_ff + d_model


def moe_gpt_params(vocab: int, seq_len: int, d_model: int, n_layers: int, n_experts: int, k: int,
                   d_ff: int | None = None) -> tuple[int, int]:
    """(total, active) parameters of the course GPT with every MLP a mixture of E experts (k per token).

    per layer: attention 4h^2 + 4h, two LayerNorms 4h, router h E, experts E (2 h d_ff + d_ff + h);
    outside: token and position embeddings (V + S) h, final LayerNorm 2h, head V h (no bias).
    """
    h, f = d_model, d_ff or 4 * d_model
    dense = n_layers * (4 * h * h + 8 * h + h * n_experts) + (2 * vocab + seq_len + 2) * h
    return dense + n_layers * n_experts * expert_params(h, f), dense + n_layers * k * expert_params(h, f)


def ep_model_state_bytes(dense_params: float, expert_params_total: float, ep: int, dp: int,
                         bytes_per_param: float = 16, shard_dense: bool = False,
                         shard_experts_over_dp: bool = False) -> float:
    """Model-state bytes per rank with experts sharded over ep (E/ep experts each) and the dense parts
    data-parallel (replicated, or `shard_dense`: sharded over all ep x dp ranks, ZeRO-3 / FSDP style);
    `shard_experts_over_dp`: each expert's states also sharded over its dp replicas."""
    dense = dense_params / (ep * dp) if shard_dense else dense_params
    experts = expert_params_total / ep / (dp if shard_experts_over_dp else 1)
    return bytes_per_param * (dense + experts)
