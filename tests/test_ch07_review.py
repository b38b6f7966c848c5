"""Chapter 7's review fixes (issue 26), each held by a value: ZeRO-3 across InfiniBand does not hide at one
sequence per GPU (chapter 5's T >= F/β rule), a column-parallel layer with a gathered output all-gathers, and
a vocabulary-parallel cross-entropy takes three all-reduces of B x S numbers (lab 7's exercise 3 and its answer)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distlab.theory import overlap
from distlab.theory import tensor_parallel as th
from distlab.theory.hardware import H100

ROOT = Path(__file__).resolve().parents[1]


def test_zero3_gathers_across_infiniband_cannot_hide_behind_one_sequence():
    """Lecture 07, section 7: h = 8192, S = 4096 tokens per GPU, 64 GPUs, bf16, H100 at peak."""
    h, s = 8192, 4096
    wire = th.zero3_block_bytes(12 * h * h, 64) / (H100.ib_GBps * 1e9)
    compute = th.block_train_flops(s, s, h) / (H100.bf16_TFLOPs * 1e12)
    assert wire == pytest.approx(0.0951, rel=1e-3) and compute == pytest.approx(0.0217, rel=1e-2)
    assert wire / compute > 4                                    # several times the compute: nothing hides it
    hide = overlap.tokens_to_hide(H100, "ib", world_size=64)    # T >= F/β (x 3b/6 x (N-1)/N)
    assert s < hide < 5 * s
    # The rule and the block arithmetic agree: at T = hide tokens the matmul compute equals the wire time.
    assert th.zero3_block_bytes(12 * h * h, 64) / (H100.ib_GBps * 1e9) == pytest.approx(
        72 * hide * h * h / (H100.bf16_TFLOPs * 1e12))


def test_gathered_column_parallel_output_all_gathers():
    """Measured on 2 gloo ranks: ColwiseParallel(output_layouts=Replicate()) all-gathers its output forward and
    all-reduces its input gradient backward, each at the closed form's bytes."""
    import distlab
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel
    from distlab.course.tensor_parallel.measure import colwise_gathered
    from distlab.course.tensor_parallel.model import TP_PRESETS
    cfg, b, t = TP_PRESETS["tp-small"], 2, 2
    out = distlab.launch(colwise_gathered, t, args=(ColwiseParallel(output_layouts=Replicate()), b, "tp-small"))
    for o in out:
        assert dict(o["fwd"].calls) == {"all_gather": 1}
        assert o["fwd"].total_bytes == th.column_gather_bytes(b * cfg.seq_len, 4 * cfg.d_model, t, bytes_per_element=4)
        assert dict(o["bwd"].calls) == {"all_reduce": 1}
        assert o["bwd"].total_bytes == th.tp_block_bytes(b * cfg.seq_len, cfg.d_model, t, bytes_per_element=4) / 4
        assert o["dy"] < 1e-5 and o["dx"] < 1e-5


def test_vocabulary_parallel_cross_entropy_takes_three_all_reduces():
    """The answer's algorithm on t vocabulary slices, the all-reduces written as sums over slices: max, sum of
    exponentials and the target's logit (held by one slice only) are three reductions of B x S numbers; it
    equals F.cross_entropy. Lab 7's exercise 3 and the answer sketch say three."""
    g = torch.Generator().manual_seed(0)
    tokens, vocab, t = 12, 40, 4
    logits, target = torch.randn(tokens, vocab, generator=g), torch.randint(0, vocab, (tokens,), generator=g)
    parts, lo = logits.chunk(t, 1), [i * vocab // t for i in range(t)]
    reductions = 0
    m = torch.stack([z.max(1).values for z in parts]).max(0).values; reductions += 1           # all-reduce MAX
    s = sum((z - m[:, None]).exp().sum(1) for z in parts); reductions += 1                   # all-reduce SUM
    mine = [torch.where((target >= a) & (target < a + z.shape[1]), z.gather(1, (target - a).clamp(0, z.shape[1] - 1)[:, None])[:, 0],
                        torch.zeros(tokens)) for a, z in zip(lo, parts)]
    z_y = sum(mine); reductions += 1                                                         # all-reduce SUM
    loss = (m + s.log() - z_y).mean()
    assert loss == pytest.approx(F.cross_entropy(logits, target).item(), abs=1e-6)
    assert reductions == 3
    lab = json.loads((ROOT / "solutions/07_tensor_parallel.ipynb").read_text())
    text = " ".join("".join(c["source"]) for c in lab["cells"] if c["cell_type"] == "markdown").replace("\n", " ")
    assert "three all-reduces of B×S numbers" in text and "two all-reduces of B×S numbers" not in text
    answer = (ROOT / "solutions/exercises/07_tensor_parallel.md").read_text().replace("\n", " ")
    assert "Three all-reduces of B×S numbers" in answer


def test_dropout_rng_under_tp_one_seed_for_replicas_one_per_rank_inside():
    """Lecture 07's pitfall, measured on 2 ranks: a seed per rank desynchronises the replicated output; one seed
    keeps it but draws the same attention masks on every rank's heads; the TP-region RNG gives both."""
    import distlab
    from distlab.course.tensor_parallel.dropout_rng import agreement, dropout_rng_runs
    from test_ch07_ratios import lecture_tp
    tp = lecture_tp()                     # the lecture's plan: the same cut the lecture measures
    modes = ("seed per rank", "one seed", "one seed + TP-region RNG")
    r0, r1 = distlab.launch(dropout_rng_runs, 2, args=(tp.parallelize, tp.my_tokens, tp.TPRegionRNG, "tp-small", 2, modes))
    independent = 1 - 2 * 0.1 * 0.9
    per_rank, one, tracker = ((r0[m], r1[m]) for m in modes)
    assert (per_rank[0]["out"] - per_rank[1]["out"]).abs().max() > 0.1
    assert agreement(per_rank[0]["attn"][0], per_rank[1]["attn"][0]) == pytest.approx(independent, abs=0.02)
    assert torch.equal(one[0]["out"], one[1]["out"])
    assert agreement(one[0]["attn"][0], one[1]["attn"][0]) == 1.0
    assert torch.equal(tracker[0]["out"], tracker[1]["out"])
    assert agreement(tracker[0]["resid"][0], tracker[1]["resid"][0]) == 1.0
    assert agreement(tracker[0]["attn"][0], tracker[1]["attn"][0]) == pytest.approx(independent, abs=0.02)
