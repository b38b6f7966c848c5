"""Closed forms for tensor, sequence and context parallelism (chapter 7). Pure functions, no ranks.

Names: B batch (rows per tensor-parallel group), S sequence length, h = d_model,
a = attention heads, t = tensor-parallel degree, cp = context-parallel degree,
e = bytes per activation element (2 in bf16, 4 in fp32), T = B x S tokens.
"Bytes" on the wire are algorithmic bytes one rank sends (ring formulas, as
`distlab.meters.track_comm` books them).

Megatron-LM's tensor parallelism (Shoeybi et al., 2019) cuts each block at two
points: a column-parallel linear (Q K V; the MLP's first layer) whose input is
copied by the operator f (identity forward, all-reduce of the input gradient
backward), then a row-parallel linear (the attention output; the MLP's second
layer) whose partial sums the operator g adds up (all-reduce forward, identity
backward). So a block all-reduces B S h elements twice forward and twice backward.

Sequence parallelism (Korthikanti et al., 2022) replaces each all-reduce by a
reduce-scatter (to the sequence shard the LayerNorm and dropout work on) and an
all-gather (back to the full sequence for the next column-parallel linear):
the same bytes, and the activations outside the tensor-parallel region shrink
by t. The activation model of that paper, per layer, with dropout and 2-byte
activations:

    no parallelism         S B h (34 + 5 a S / h)
    tensor parallel        S B h (10 + 24 / t + 5 a S / (h t))
    tensor + sequence      S B h (34 / t + 5 a S / (h t))
    + selective recompute  drops the 5 a S / h term; full recompute keeps 2 S B h (the layer's input)
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def _positive(**values: float) -> None:
    for name, v in values.items():
        if v is None or v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


# ---- traffic ----------------------------------------------------------------------------------------

def tp_block_bytes(tokens: float, d_model: int, t: int, *, bytes_per_element: float = 2,
                   backward: bool = True) -> float:
    """Bytes one rank sends per block per step with Megatron TP: all-reduces of T x h elements,
    two forward (g after attention and after the MLP) and two backward (f before them), each
    2(t-1)/t x S."""
    _positive(tokens=tokens, d_model=d_model, t=t)
    calls = 4 if backward else 2
    return calls * 2 * (t - 1) / t * tokens * d_model * bytes_per_element


def column_gather_bytes(tokens: float, d_out: int, t: int, *, bytes_per_element: float = 2) -> float:
    """Bytes one rank sends when a column-parallel linear's output is gathered whole (no row-parallel layer after
    it, as a head whose logits are wanted on every rank): one all-gather of its T x d_out output forward,
    (t-1)/t x T d_out e. Its backward all-reduces the input gradient (f), as in the MLP, and slices the output
    gradient locally. So plain TP all-gathers too: whenever a column-parallel output leaves the TP region whole."""
    _positive(tokens=tokens, d_out=d_out, t=t)
    return (t - 1) / t * tokens * d_out * bytes_per_element


def sp_block_bytes(tokens: float, d_model: int, t: int, *, bytes_per_element: float = 2,
                   backward: bool = True, regather: bool = False) -> float:
    """Bytes one rank sends per block per step with sequence parallelism.

    Forward: an all-gather before attention and before the MLP, a reduce-scatter after each;
    backward mirrors them (reduce-scatter, all-gather): 8 collectives of (t-1)/t x T h e, the
    same bytes as TP's 4 all-reduces. `regather`: the column-parallel linears kept only their
    input's shard and all-gather it again in backward (Megatron's choice): 2 all-gathers more.
    """
    _positive(tokens=tokens, d_model=d_model, t=t)
    calls = (8 if backward else 4) + (2 if regather and backward else 0)
    return calls * (t - 1) / t * tokens * d_model * bytes_per_element


def sp_replicated_grad_bytes(d_model: int, t: int, *, bytes_per_element: float = 4, biases: bool = True) -> float:
    """Under SP the parameters every rank holds whole but applies to its slice of the sequence only
    get partial gradients, all-reduced once per step: the two LayerNorms (4h) and, when they are added
    after the reduce-scatter (Megatron, the lab), the row-parallel linears' biases (2h). PyTorch's
    `RowwiseParallel` adds its bias before the reduce-scatter: `biases=False`, 4h."""
    _positive(d_model=d_model, t=t)
    return 2 * (t - 1) / t * (6 if biases else 4) * d_model * bytes_per_element


def zero3_block_bytes(params_per_block: float, world_size: int, *, bytes_per_param: float = 2) -> float:
    """Bytes one rank sends per block per step under ZeRO-3 / FSDP: the weights gathered for
    forward and again for backward, the gradients reduce-scattered: 3 x (N-1)/N x Ψ_block bytes."""
    _positive(params_per_block=params_per_block, world_size=world_size)
    n = world_size
    return 3 * (n - 1) / n * params_per_block * bytes_per_param


def zero3_tp_crossover_tokens(params_per_block: float, d_model: int, *, bytes_per_param: float = 2,
                              bytes_per_element: float = 2) -> float:
    """Tokens per step T* at which TP (t = N) and ZeRO-3 (N ranks) send the same bytes per block.

    8(t-1)/t T h e = 3(N-1)/N Ψ_b p  =>  T* = 3 Ψ_b p / (8 h e). For Ψ_b ≈ 12h^2 and p = e that is
    4.5 h tokens. Fewer tokens per step: TP sends less; more: ZeRO-3 sends less (its bytes do not
    grow with the batch, TP's do).
    """
    _positive(params_per_block=params_per_block, d_model=d_model)
    return 3 * params_per_block * bytes_per_param / (8 * d_model * bytes_per_element)


def ring_attention_bytes(batch: float, seq: float, d_model: int, cp: int, *,
                         bytes_per_element: float = 2) -> float:
    """Bytes one rank sends in a ring-attention forward: cp-1 steps, each passing its current
    K and V blocks (B x S/cp x h each) to the next rank: 2(cp-1)/cp x B S h e.
    (Training adds a backward ring that passes K, V and their gradients again.)"""
    _positive(batch=batch, seq=seq, d_model=d_model, cp=cp)
    return 2 * (cp - 1) / cp * batch * seq * d_model * bytes_per_element


def ulysses_bytes(batch: float, seq: float, d_model: int, cp: int, *, bytes_per_element: float = 2) -> float:
    """Bytes one rank sends in an all-to-all (DeepSpeed-Ulysses) attention forward: Q, K, V go from
    sequence shards to head shards and the output comes back, four all-to-alls, each sending
    (cp-1)/cp of a rank's B x S/cp x h block: 4(cp-1)/cp^2 x B S h e (needs cp | heads)."""
    _positive(batch=batch, seq=seq, d_model=d_model, cp=cp)
    return 4 * (cp - 1) / cp ** 2 * batch * seq * d_model * bytes_per_element


def tp_block_params_per_rank(d_model: int, t: int) -> float:
    """Parameters one rank of a tensor-parallel group holds of a block (chapter 7's layout):
    the split weights and the column-parallel biases, (12h^2 + 7h)/t, and whole on every rank the
    two LayerNorms (4h) and the row-parallel biases (2h)."""
    _positive(d_model=d_model, t=t)
    h = d_model
    return (12 * h * h + 7 * h) / t + 6 * h


# ---- activations -----------------------------------------------------------------------------------

def activation_bytes_per_layer(seq: float, batch: float, d_model: int, n_heads: int, *, t: int = 1,
                               sp: bool = False, sp_keeps_shard: bool = True, recompute: str = "none",
                               bytes_per_element: float = 2, dropout: bool = True, mask_bytes: float = 1,
                               layernorm_stats: bool = False) -> float:
    """Bytes one rank keeps for backward per transformer layer (Korthikanti et al., 2022, section 4).

    Per layer, in units of S B h elements of e bytes: LayerNorm inputs 1 + 1 and outputs 1 + 1
    (replicated across the t ranks; divided by t under SP), Q K V 3/t, the attention output 1/t,
    the MLP's 4/t + 4/t; two dropout masks of S B h x `mask_bytes`; and per head an S x S score
    matrix kept twice (softmax and dropout outputs) plus its mask: a S^2 B (2e + mask) / t.
    With e = 2, mask 1: S B h (34 + 5 a S / h) for t = 1.

    `sp_keeps_shard=False` models PyTorch's `SequenceParallel` + `ColwiseParallel`: the linears
    keep the all-gathered (full) LayerNorm output, 2 S B h e per layer that Megatron's SP avoids by
    gathering again in backward. `dropout=False`: no masks, and the softmax output is the tensor
    attention multiplies V by (kept once: a S^2 B e / t). `layernorm_stats`: add each LayerNorm's
    fp32 mean and 1/std per token (16 S B bytes per layer; the paper leaves them out).
    `recompute`: "selective" recomputes the attention core (drops the S^2 term); "full" keeps only
    the layer's input (S B h e, divided by t under SP).
    """
    _positive(seq=seq, batch=batch, d_model=d_model, n_heads=n_heads, t=t)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
    e, m = bytes_per_element, (mask_bytes if dropout else 0)
    sbh = seq * batch * d_model
    outside = t if sp else 1                       # what SP divides: LayerNorm, dropout, residual
    if recompute == "full":
        return sbh * e / outside
    ln_inputs = 2 * e / outside
    ln_outputs = 2 * e / (outside if sp_keeps_shard else 1)
    masks = 2 * m / outside
    inside = 12 * e / t                            # Q, K, V, attention output, MLP 4h + 4h
    total = sbh * (ln_inputs + ln_outputs + masks + inside)
    if recompute == "none":
        total += n_heads * seq * seq * batch * ((2 * e + m) if dropout else e) / t
    if layernorm_stats:
        total += 2 * 2 * 4 * seq * batch / outside
    return total


def paper_coefficients(seq: float, d_model: int, n_heads: int, t: int = 1, sp: bool = False) -> tuple[float, float]:
    """(c, d) with activation bytes per layer = S B h (c + d a S / h), e = 2, dropout on: (34, 5) at t = 1."""
    per = activation_bytes_per_layer(seq, 1, d_model, n_heads, t=t, sp=sp, recompute="selective")
    core = activation_bytes_per_layer(seq, 1, d_model, n_heads, t=t, sp=sp) - per
    sbh = seq * d_model
    return per / sbh, core / sbh / (n_heads * seq / d_model)


# ---- time on a GPU cluster (arithmetic from nominal figures, not a measurement) --------------------

def block_train_flops(tokens: float, seq: float, d_model: int) -> float:
    """FLOPs of one block's forward + backward: 72 T h^2 (matmuls, 3x the forward's 24 T h^2)
    + 12 T S h (attention scores and their product with V)."""
    return 72 * tokens * d_model ** 2 + 12 * tokens * seq * d_model


def ring_overlap_block_tokens(peak_flops: float, link_GBps: float, *, bytes_per_element: float = 2) -> float:
    """Tokens per rank's block (S/cp) above which a ring-attention step computes longer than it
    takes to pass its K and V blocks on: 4 B (S/cp)^2 h FLOPs against 2 B (S/cp) h e bytes, so
    S/cp >= F e / (2 β). At peak FLOP/s; a real kernel reaches less, which only helps the overlap."""
    return peak_flops * bytes_per_element / (2 * link_GBps * 1e9)


def tp_comm_seconds(tokens: float, d_model: int, t: int, link_GBps: float, *, bytes_per_element: float = 2) -> float:
    """Seconds one block's TP all-reduces take per step if they run at the link's bandwidth."""
    return tp_block_bytes(tokens, d_model, t, bytes_per_element=bytes_per_element) / (link_GBps * 1e9)


# ---- peak of a training step (chapter 7's language model, `distlab.course.tensor_parallel.model`) ------------

def lm_params_per_rank(d_model: int, n_layers: int, vocab: int, seq: int, t: int = 1) -> float:
    """Parameters one rank of a tensor-parallel group holds of chapter 7's language model: the blocks'
    `tp_block_params_per_rank`, and whole on every rank the token and position embeddings, the final LayerNorm
    and the (untied) head: 2 V h + S h + 2h."""
    _positive(d_model=d_model, n_layers=n_layers, vocab=vocab, seq=seq, t=t)
    h = d_model
    return n_layers * tp_block_params_per_rank(h, t) + 2 * vocab * h + seq * h + 2 * h


def lm_outside_bytes(batch: float, seq: float, d_model: int, vocab: int, *, bytes_per_element: float = 4,
                     loss_bytes_per_element: float = 4) -> float:
    """Bytes a rank holds outside the blocks when backward starts (replicated under TP, not divided by t).

    Kept from forward: the embeddings' sum (the first block's input) and the final LayerNorm's output (the head's
    input), 2 T h e; the final LayerNorm's two fp32 statistics per token, 8 T; the batch's token ids, one
    (B, S+1) int64 tensor that input and target view, 8 B (S+1); the cross-entropy's log-probabilities, T V in
    fp32. Made as backward starts: the gradient of those log-probabilities and that of the logits, 2 T V fp32 —
    the step's peak for a vocabulary as wide as the model is small (the logits themselves were freed: nothing
    keeps them)."""
    _positive(batch=batch, seq=seq, d_model=d_model, vocab=vocab)
    tokens = batch * seq
    return (2 * tokens * d_model * bytes_per_element + 8 * tokens + 8 * batch * (seq + 1)
            + 3 * tokens * vocab * loss_bytes_per_element)


def lm_train_peak_bytes(batch: float, seq: float, d_model: int, n_heads: int, n_layers: int, vocab: int, t: int = 1,
                        *, bytes_per_element: float = 4, optimizer_bytes_per_param: float = 4,
                        buffer_bytes: float = 0, sp: bool = False) -> float:
    """Peak bytes of one training step of chapter 7's language model on a rank of a TP group (fp32, no dropout).

    Weights (+ `buffer_bytes`, such as the causal masks) and optimizer state (`optimizer_bytes_per_param`: 4 for
    SGD's momentum, 8 for Adam) live throughout. On top, the larger of two moments:

    - backward starts: the blocks' activations (`activation_bytes_per_layer`, with the LayerNorms' statistics)
      and `lm_outside_bytes` (the loss's T x V tensors);
    - backward ends: every gradient (one per weight), the activations all freed.

    The first wins while activations outweigh a copy of the weights (the chapter's sizes); the second when
    they do not. Between the two, memory moves from one to the other block by block, and a block's backward
    temporaries can lift it a little above both: a model of two moments, not a simulation of every op.
    """
    psi = lm_params_per_rank(d_model, n_layers, vocab, seq, t)
    e = bytes_per_element
    states = psi * e + buffer_bytes + psi * optimizer_bytes_per_param
    act = n_layers * activation_bytes_per_layer(seq, batch, d_model, n_heads, t=t, sp=sp, sp_keeps_shard=False,
                                                bytes_per_element=e, dropout=False, layernorm_stats=True)
    start = states + act + lm_outside_bytes(batch, seq, d_model, vocab, bytes_per_element=e)
    end = states + psi * e
    return max(start, end)


# ---- context parallelism: what a training step keeps -------------------------------------------------------

def ring_attention_activation_bytes(batch: float, heads: int, seq: float, head_dim: int, cp: int, *,
                                    bytes_per_element: float = 2) -> float:
    """Bytes a rank keeps for backward from a ring-attention forward written as one autograd Function that
    recomputes each block's scores in backward (as FlashAttention does, and as ring attention is meant to run):
    its output block and the log-sum-exp of its scores, B a (S/cp) (hd + 1) e — linear in S/cp, where one
    process keeps a S^2 B e of probabilities. (Q, K, V are its inputs: the layers before keep them anyway.)"""
    _positive(batch=batch, heads=heads, seq=seq, head_dim=head_dim, cp=cp)
    return batch * heads * seq / cp * (head_dim + 1) * bytes_per_element


def ring_attention_backward_bytes(batch: float, seq: float, d_model: int, cp: int, *,
                                  bytes_per_element: float = 2) -> float:
    """Bytes one rank sends in that Function's backward ring: the K, V blocks again (cp-1 hops) and their
    gradients, which travel with them and take one more hop home (cp hops): 2(2cp-1)/cp x B S h e."""
    _positive(batch=batch, seq=seq, d_model=d_model, cp=cp)
    return 2 * (2 * cp - 1) / cp * batch * seq * d_model * bytes_per_element


def attention_activation_bytes(batch: float, heads: int, seq: float, head_dim: int, *,
                               bytes_per_element: float = 2) -> float:
    """Bytes one process's causal attention core (softmax, then times V; no dropout) keeps for backward beyond
    its inputs: the probabilities, a S^2 B e, and its output, B a S hd e."""
    _positive(batch=batch, heads=heads, seq=seq, head_dim=head_dim)
    return batch * heads * seq * (seq + head_dim) * bytes_per_element


def ring_attention_forward_peak_bytes(batch: float, heads: int, seq: float, head_dim: int, cp: int, *,
                                      rank: int | None = None, bytes_per_element: float = 2,
                                      mask_bytes: float = 1, kernel_temporaries: bool = False) -> float:
    """Peak bytes of chapter 7's `ring_forward` (the lecture's causal ring, one (S/cp)^2 block of scores at a
    time) on rank `rank` (default the last, which computes all cp blocks), above its inputs Q, K, V.

    Units: Q = B a (S/cp) hd e (a block of queries), L = Q / hd (a log-sum-exp), Sc = B a (S/cp)^2 e (a block of
    scores), M = (S/cp)^2 `mask_bytes` (a causal mask). The ring carries its output (Q) and log-sum-exp (L), the
    K, V block in hand (2Q) and, on every step but the last, the one in flight (2Q); from its second block on
    also the previous block's output and log-sum-exp (Q + L): the names `o, l` hold them until the next block
    rebinds them. On top of that, the largest of three moments of a step that computes:

    - the causal mask, on the diagonal block: scores and two masks (`torch.ones` and its `triu`), Sc + 2M;
    - the block's output: scores, its log-sum-exp and its output, Sc + L + Q;
    - the merge: the new log-sum-exp and the two rescaled outputs with their sum, L + 3Q (scores freed).

    So the last rank of a ring of cp >= 3 peaks at 7Q + 3L + Sc on its second step once S/cp >= 3 hd (6Q + 2L + Sc
    on the first rank, which merges only its own block). `kernel_temporaries`: add what `logsumexp` allocates
    inside (exp of the scores minus their maximum, one more Sc): CUDA's allocator counts it, the CPU meter, which
    books the tensors operators return, does not.
    """
    _positive(batch=batch, heads=heads, seq=seq, head_dim=head_dim, cp=cp)
    r = cp - 1 if rank is None else rank
    if not 0 <= r < cp:
        raise ValueError(f"rank must be in 0..{cp - 1}, got {rank}")
    e, blk = bytes_per_element, seq / cp
    q = batch * heads * blk * head_dim * e
    lse = q / head_dim
    scores = batch * heads * blk * blk * e
    mask = blk * blk * mask_bytes
    peak = 0.0
    for step in range(r + 1):                    # rank r computes blocks r, r-1, ..., 0: steps 0..r
        carried = q + lse + 2 * q + (q + lse if step else 0) + (2 * q if step < cp - 1 else 0)
        after = carried - (q + lse if step else 0) + q + lse      # the previous o, l replaced by this block's
        moments = [carried + scores + lse + q, after + lse + 3 * q]
        if step == 0:
            moments.append(carried + scores + 2 * mask)
        if kernel_temporaries:
            moments.append(carried + 2 * scores + lse)
        peak = max(peak, *moments)
    return peak
