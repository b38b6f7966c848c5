"""Chapter 7's closed forms, without ranks: the paper's activation coefficients, TP/SP/CP bytes, the
ZeRO-3 vs TP crossover; and the activation model against autograd's saved tensors, to the byte."""
from __future__ import annotations

import pytest
import torch

from distlab.theory import tensor_parallel as th


def test_the_papers_activation_coefficients():
    s, h, a = 2048, 4096, 32
    assert th.paper_coefficients(s, h, a) == pytest.approx((34, 5))
    for t in (2, 4, 8):
        c, d = th.paper_coefficients(s, h, a, t=t)
        assert (c, d) == pytest.approx((10 + 24 / t, 5 / t))
        c, d = th.paper_coefficients(s, h, a, t=t, sp=True)
        assert (c, d) == pytest.approx((34 / t, 5 / t))
    sbh = s * h
    assert th.activation_bytes_per_layer(s, 1, h, a, recompute="full") == 2 * sbh
    assert th.activation_bytes_per_layer(s, 1, h, a, t=8, sp=True, recompute="full") == 2 * sbh / 8
    assert th.activation_bytes_per_layer(s, 1, h, a, t=8, sp=True, recompute="selective") == pytest.approx(34 * sbh / 8)
    # PyTorch's SequenceParallel keeps the all-gathered LayerNorm outputs: 4 + 30/t instead of 34/t.
    torch_sp = th.activation_bytes_per_layer(s, 1, h, a, t=4, sp=True, sp_keeps_shard=False, recompute="selective")
    assert torch_sp == pytest.approx((4 + 30 / 4) * sbh)


def test_activation_arguments_are_checked():
    with pytest.raises(ValueError, match="recompute"):
        th.activation_bytes_per_layer(16, 1, 64, 8, recompute="some")
    with pytest.raises(ValueError, match="divide"):
        th.activation_bytes_per_layer(16, 1, 64, 7)
    with pytest.raises(ValueError, match=">= 1"):
        th.tp_block_bytes(0, 64, 2)


def test_tp_sp_and_ring_bytes():
    T, h, e = 4096, 1024, 2
    for t in (1, 2, 4, 8):
        tp = th.tp_block_bytes(T, h, t, bytes_per_element=e)
        assert tp == pytest.approx(4 * 2 * (t - 1) / t * T * h * e)
        assert th.sp_block_bytes(T, h, t, bytes_per_element=e) == pytest.approx(tp)       # same bytes
        assert th.sp_block_bytes(T, h, t, bytes_per_element=e, regather=True) == pytest.approx(tp * 10 / 8)
        assert th.tp_block_bytes(T, h, t, bytes_per_element=e, backward=False) == pytest.approx(tp / 2)
    assert th.sp_replicated_grad_bytes(64, 2) == 2 * 0.5 * 6 * 64 * 4
    for cp in (2, 4, 8):
        ring, uly = th.ring_attention_bytes(2, 4096, h, cp), th.ulysses_bytes(2, 4096, h, cp)
        assert ring / uly == pytest.approx(cp / 2)


def test_zero3_tp_crossover_is_4_5_h_tokens_for_12h2_blocks():
    h, n = 4096, 8
    psi_b = 12 * h * h
    star = th.zero3_tp_crossover_tokens(psi_b, h)
    assert star == pytest.approx(4.5 * h)
    assert th.tp_block_bytes(star, h, n) == pytest.approx(th.zero3_block_bytes(psi_b, n))
    assert th.tp_block_bytes(star / 2, h, n) < th.zero3_block_bytes(psi_b, n) < th.tp_block_bytes(2 * star, h, n)


def test_block_flops_and_link_seconds():
    assert th.block_train_flops(1, 1, 1) == 84
    # 4 all-reduces of 1 GB-ish: t = 2 sends 4 x 1 x S, at 1 GB/s
    assert th.tp_comm_seconds(1e9 / 2 / 1024, 1024, 2, 1.0) == pytest.approx(4 * 1.0)


@pytest.mark.parametrize("dropout, recompute", [(0.0, "none"), (0.1, "none"), (0.1, "selective"), (0.1, "full")])
def test_activation_model_is_autograds_saved_tensors_to_the_byte(dropout, recompute):
    """One process, fp32 (e = 4), 1-byte dropout masks: bytes alive after forward = the model exactly."""
    from distlab.meters import track_memory
    from distlab.course.tensor_parallel.model import TPConfig, build_stack
    for s, b in ((32, 2), (64, 1)):
        cfg = TPConfig(seq_len=s, d_model=32, n_heads=4, n_layers=2, dropout=dropout, recompute=recompute)
        model = build_stack(cfg, device="cpu")
        x = torch.randn(b, s, 32, requires_grad=True)
        with track_memory("cpu") as mem:
            y = model(x)
            kept = mem.current_bytes
            y.sum().backward()
        want = 2 * th.activation_bytes_per_layer(s, b, 32, 4, recompute=recompute, bytes_per_element=4,
                                                 dropout=dropout > 0, layernorm_stats=True)
        assert kept == want, (s, b, kept, want)


def test_ring_forward_peak_moments():
    b, a, hd, e = 2, 8, 16, 4
    for cp, seq in ((4, 1024), (3, 768), (2, 512)):
        blk = seq // cp
        q, lse, sc = b * a * blk * hd * e, b * a * blk * e, b * a * blk * blk * e
        peak = lambda r, **kw: th.ring_attention_forward_peak_bytes(b, a, seq, hd, cp, rank=r, bytes_per_element=e, **kw)
        assert peak(0) == 6 * q + 2 * lse + sc                        # its own block only
        # the last rank: a second block with one in flight (cp >= 3), or without (cp = 2: the first step is larger)
        assert peak(cp - 1) == (7 * q + 3 * lse + sc if cp > 2 else 6 * q + 2 * lse + sc)
        assert peak(cp - 1, kernel_temporaries=True) == peak(cp - 1) - q + sc      # logsumexp's Sc, not the output yet
    # short blocks (S/cp < 3 hd): the merge's three rescaled outputs are the peak
    q, lse = 1 * 2 * 32 * 32 * 4, 1 * 2 * 32 * 4
    assert th.ring_attention_forward_peak_bytes(1, 2, 96, 32, 3, bytes_per_element=4) == 9 * q + 3 * lse
    with pytest.raises(ValueError, match="rank"):
        th.ring_attention_forward_peak_bytes(1, 2, 96, 32, 3, rank=3)
