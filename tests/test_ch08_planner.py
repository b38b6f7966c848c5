"""The planner's honest terms (issue 26): the vocabulary-parallel head's f on the last stage, headroom,
the buffers beside model states, and which framework runs a layout."""
from __future__ import annotations

import pytest

from distlab.course.planner import Cluster, Layout, ModelSpec, Workload, frameworks, markdown, plan


def test_vocab_parallel_head_all_reduces_its_input_gradient_and_the_cross_entropy():
    spec = ModelSpec(4, 32, 2, vocab_size=128, max_seq=16)
    L = Layout(dp=1, tp=2, pp=2, micro_batch=2, m=4)
    on = plan(spec, L, Workload(16, 8), act_bytes=4, vocab_parallel=True)
    off = plan(spec, L, Workload(16, 8), act_bytes=4, vocab_parallel=False)
    act, ring, bs = 2 * 16 * 32 * 4, 2 * (2 - 1) / 2, 2 * 16
    assert off.traffic["tp"] == [4 * 4 * 2 * act * ring] * 2                      # 4 calls per block, 2 blocks
    assert on.traffic["tp"][0] == 4 * (4 * 2 + 1) * act * ring                     # + the embedding's g
    assert on.traffic["tp"][1] == 4 * ((4 * 2 + 1) * act + 3 * bs * 4) * ring     # + the head's f, the loss's 3


def test_headroom_and_buffers_count_against_memory():
    c = Cluster(8, memory_GB=80)
    assert c.usable_bytes == pytest.approx((80 - 1.5) * 1e9 * 0.95)
    spec = ModelSpec.from_size(7e9)
    p3 = plan(spec, Layout(dp=8, zero=3, m=4), Workload(4096, 32), c)
    p1 = plan(spec, Layout(dp=8, zero=1, m=4), Workload(4096, 32), c)
    assert p3.buffers["gathered"][0] > 0 and p1.buffers["gathered"][0] == 0
    assert p1.buffers["fp32 grads"][0] == pytest.approx(2 * p1.params_local[0])    # 4 - 2 bytes, whole gradient
    assert p3.buffers["fp32 grads"][0] == pytest.approx(2 * -(-p3.params_local[0] // 8))
    assert p1.buffers["logits"][0] > 0
    assert p1.memory_bytes == pytest.approx(p1.model_state_bytes[0] + p1.activation_bytes[0] + p1.buffer_bytes[0])
    one = plan(spec, Layout(dp=8, zero=1, m=1), Workload(4096, 8), c, accum_bytes=4)
    assert one.buffers["fp32 grads"][0] == 0                                     # nothing to accumulate


def test_frameworks_say_who_runs_a_layout():
    assert frameworks(Layout(dp=2, pp=2, zero=2, m=4)) == "torchtitan (FSDP2 + pipelining) only"
    assert "Megatron-LM" in frameworks(Layout(dp=2, pp=2, zero=1, m=4))
    assert "runs on" in markdown([plan(ModelSpec(4, 32, 2), Layout(dp=2, pp=2, m=4), Workload(16, 8))])
    assert "algorithmic bytes" in markdown([plan(ModelSpec(4, 32, 2), Layout(dp=2, pp=2, m=4), Workload(16, 8))])


def test_mfu_is_an_output_of_each_plan_not_a_constant():
    """Issue 26: the planner's MFU falls below the kernels' assumed efficiency by the bubble, the exposed
    communication and recomputation, and differs between layouts."""
    from distlab.course import planner as pl
    spec = pl.ModelSpec.from_size(70e9)
    work = pl.Workload(global_batch=1024, seq_len=4096)
    cluster = pl.Cluster(gpus=256)
    plans = pl.candidates(spec, work, cluster)
    for p in plans[:20]:
        assert 0 < p.mfu <= cluster.mfu + 1e-12
        assert p.mfu == pytest.approx(spec.flops_per_token(work.seq_len) * work.global_batch * work.seq_len
                                      / (p.layout.gpus * cluster.gpu.bf16_TFLOPs * 1e12 * p.step_s))
    assert len({round(p.mfu, 4) for p in plans}) > 3
    assert "MFU (est.)" in pl.markdown(plans[:3], cluster)
