"""Chapter 9's training room: the corpus split, the sharded loader's arithmetic (no ranks), checkpoints
written then renamed, a resumed run equal to the uninterrupted one, a killed rank, clear errors."""
from __future__ import annotations

import zlib

import pytest
import torch

import distlab
from distlab.course.training import (ShardedLoader, TrainConfig, corpus, global_rows, rank_rows, stdlib_files,
                                     train)
from distlab.course.training import checkpoint as ckpt
from distlab.course.training.corpus import VAL_EVERY, is_validation, stdlib_root
from distlab.course.training.strategies import check_strategy, data_ranks

TINY = dict(max_bytes=200_000, batch_size=8, seq_len=32, d_model=32, n_heads=2)


def test_corpus_is_the_stdlib_split_by_file():
    files = stdlib_files()
    rel = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel) and not any("/test/" in f"/{r}" for r in rel)
    val = [r for r in rel if is_validation(r)]
    assert val == [r for r in rel if zlib.crc32(r.encode()) % VAL_EVERY == 0]
    text = corpus(TINY["max_bytes"])
    assert text.train.dtype == torch.uint8 and text.val.numel() > 0
    assert text.train.numel() >= 0.95 * TINY["max_bytes"] and text.val.numel() >= TINY["max_bytes"] / VAL_EVERY
    assert torch.equal(corpus(TINY["max_bytes"]).train, text.train)      # the cache gives the same stream


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ranks_read_disjoint_slices_that_make_up_the_global_batch(n):
    W, B = 37, 8
    seen = []
    for step in range(10):                    # 80 rows: two full epochs and a bit
        parts = [rank_rows(step, r, n, B, W, seed=3) for r in range(n)]
        assert torch.equal(torch.cat(parts), global_rows(step, B, W, seed=3))
        seen += torch.cat(parts).tolist()
    assert sorted(seen[:W]) == list(range(W)) and sorted(seen[W:2 * W]) == list(range(W))   # every window once per epoch
    assert seen[:W] != seen[W:2 * W]          # each epoch in its own order


def test_loader_position_resumes_at_another_world_size():
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    a = [ShardedLoader(tokens, seq_len=16, batch_size=8, rank=r, world_size=4, seed=1) for r in range(4)]
    for _ in range(5):
        [next(x) for x in a]
    b = [ShardedLoader(tokens, seq_len=16, batch_size=8, rank=r, world_size=2, seed=1) for r in range(2)]
    for x in b:
        x.load_state_dict(a[0].state_dict())
    x4 = torch.cat([next(x)[0] for x in a])
    x2 = torch.cat([next(x)[0] for x in b])
    assert torch.equal(x4, x2)
    xs, ys = ShardedLoader(tokens, seq_len=16, batch_size=8).batch(0)
    assert torch.equal(xs[:, 1:], ys[:, :-1])    # y is x shifted by one token
    with pytest.raises(ValueError, match="seq_len"):
        ShardedLoader(tokens, seq_len=8, batch_size=8, seed=1).load_state_dict(a[0].state_dict())
    with pytest.raises(ValueError, match="multiple of 3"):
        ShardedLoader(tokens, seq_len=16, batch_size=8, rank=0, world_size=3)


def test_bad_strategy_and_world_size_are_refused():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        check_strategy("zero4", 2)
    with pytest.raises(ValueError, match="one process"):
        check_strategy("single", 2)
    with pytest.raises(ValueError, match="ZeRO3"):
        check_strategy("zero3", 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        check_strategy("dp_tp", 3)
    with pytest.raises(ValueError, match="divides 2"):
        check_strategy("tp", 4, n_heads=2)
    with pytest.raises(ValueError, match="3 ranks would leave 1 stage"):
        check_strategy("pp", 3, n_layers=2)
    check_strategy("pp", 2, n_layers=2)
    assert data_ranks("dp_tp", 4, 3) == (1, 2) and data_ranks("tp", 2, 1) == (0, 1) and data_ranks("ddp", 2, 1) == (1, 2)
    assert data_ranks("pp", 2, 1) == (0, 1)          # every stage is fed the whole batch


def test_one_process_resumes_bit_exact_and_refuses_a_foreign_checkpoint(tmp_path):
    torch.set_num_threads(1)
    full = train(TrainConfig(steps=6, **TINY))
    train(TrainConfig(steps=4, ckpt_dir=str(tmp_path), ckpt_every=2, **TINY))
    (tmp_path / ".step_000006.tmp").mkdir()                 # a save that was killed half-way
    assert ckpt.latest(tmp_path).name == "step_000004"
    torch.manual_seed(123)
    expected_rng = torch.get_rng_state()
    resumed = train(TrainConfig(steps=6, ckpt_dir=str(tmp_path), resume=True, **TINY))
    assert resumed.resumed_from == 4 and resumed.loss == full.loss     # bit-exact, step for step
    with pytest.raises(ValueError, match="another shape"):
        train(TrainConfig(steps=6, ckpt_dir=str(tmp_path), resume=True, **{**TINY, "d_model": 64}))
    saved = torch.tensor(ckpt.read_meta(tmp_path / "step_000004")["rng"][0]["cpu"], dtype=torch.uint8)
    assert torch.equal(torch.get_rng_state(), saved) and not torch.equal(saved, expected_rng)   # RNG came back


def test_killed_rank_on_a_mesh_then_resume_in_one_process_continues_the_curve(tmp_path, no_orphans):
    """A 1 x 2 (dp x tp) mesh (parallelize_module, then fully_shard) saves 2-D DTensor shards; a rank dies;
    one process loads them resharded and continues one process's curve."""
    cfg = dict(steps=6, ckpt_dir=str(tmp_path), ckpt_every=3, **TINY)
    full = train(TrainConfig(steps=6, **TINY))
    from distlab.engine.launch import FaultInjected, run_on_ranks
    with pytest.raises(FaultInjected, match="rank 1 was killed with SIGKILL at step 4"):
        run_on_ranks(train, 2, args=(TrainConfig(strategy="dp_tp", **cfg),), fault=(1, "step 4"))
    assert ckpt.latest(tmp_path).name == "step_000003"
    resumed = train(TrainConfig(strategy="single", resume=True, **{**cfg, "ckpt_every": 0}))
    assert resumed.resumed_from == 3
    assert max(abs(a - b) for a, b in zip(resumed.loss, full.loss)) < 1e-5   # the mesh's 3 steps and the resumed 3


def test_accumulation_and_recomputation_do_not_change_the_curve():
    torch.set_num_threads(1)
    cfg = dict(steps=3, **TINY)
    plain = train(TrainConfig(**cfg)).loss
    accumulated = train(TrainConfig(accumulate=4, **cfg)).loss
    recomputed = train(TrainConfig(recompute=True, **cfg)).loss
    assert max(abs(a - b) for a, b in zip(plain, accumulated)) < 1e-5   # the mean of 4 equal means
    assert recomputed == plain                                         # the same ops, run twice
    with pytest.raises(ValueError, match="must divide"):
        train(TrainConfig(accumulate=3, **cfg))


def test_the_labs_zero3_saves_a_file_per_rank_and_resumes_bit_exact(tmp_path, no_orphans):
    """The learner's ZeRO-3 (lab 5's ShardedModule) is not DCP's kind of module: each rank torch.saves its own
    flat shards and optimizer state, and a resume at the same world size continues the curve bit for bit."""
    import shutil

    from distlab.engine.launch import run_on_ranks
    from labkit import answers
    classes = {"ZeRO3": answers("05_zero3").ZeRO3}
    cfg = dict(strategy="zero3", steps=4, ckpt_dir=str(tmp_path), ckpt_every=2, **TINY)
    full = run_on_ranks(train, 2, args=(TrainConfig(**cfg), classes))[0]
    assert sorted(p.name for p in (tmp_path / "step_000002").iterdir()) == ["distlab.json", "rank0.pt", "rank1.pt"]
    shutil.rmtree(tmp_path / "step_000004")                     # resume from step 2
    resumed = run_on_ranks(train, 2, args=(TrainConfig(resume=True, **cfg), classes))[0]
    assert resumed.resumed_from == 2 and resumed.loss == full.loss


def test_pipeline_is_one_process_accumulating_its_microbatches_and_resumes_at_another_world_size(tmp_path, no_orphans):
    """pp on 2 ranks (Schedule1F1B, 4 micro-batches) logs on every rank the loss one process gets accumulating
    the same 4 micro-batches, bit for bit (the same additions; 1/4 is exact); its DCP checkpoint, keyed by the
    whole model's names, resumes on 1 rank and continues the curve bit for bit. A pp checkpoint is refused by
    the other strategies (their optimizer state is keyed differently)."""
    from distlab.course.training import foreign
    from distlab.engine.launch import run_on_ranks
    torch.set_num_threads(1)
    cfg = dict(steps=4, accumulate=4, eval_every=2, eval_batches=1, **TINY)
    accumulated = train(TrainConfig(**cfg))
    plain = train(TrainConfig(**{**cfg, "accumulate": 1}))
    ranks = run_on_ranks(train, 2, args=(TrainConfig(strategy="pp", ckpt_dir=str(tmp_path), ckpt_every=2, **cfg),))
    assert ranks[0].loss == ranks[1].loss == accumulated.loss and ranks[0].val == ranks[1].val
    assert max(abs(a - b) for a, b in zip(ranks[0].loss, plain.loss)) < 1e-5      # one batch: rounding only
    assert max(abs(a[1] - b[1]) for a, b in zip(ranks[0].val, plain.val)) < 1e-5
    import shutil
    shutil.rmtree(tmp_path / "step_000004")
    resumed = run_on_ranks(train, 1, args=(TrainConfig(strategy="pp", ckpt_dir=str(tmp_path), resume=True, **cfg),))[0]
    assert resumed.resumed_from == 2 and resumed.loss == ranks[0].loss
    meta = ckpt.read_meta(tmp_path / "step_000002")
    mine = {k: meta[k] for k in ("model", "corpus", "data")}
    assert foreign(meta, mine, "pp") is None and "saved by strategy 'pp'" in foreign(meta, mine, "fsdp2")


def test_throughput_is_a_ratio_on_a_cpu_and_gives_mfu_on_a_known_gpu():
    """The GPU branch's arithmetic, checked on the CPU: FLOPs per token from the model's own matrices, MFU
    against the GPU's bf16 peak, per-GPU tokens/s; a CPU run prints only the ratio to one process."""
    from types import SimpleNamespace

    from distlab.course.models import build_model
    from distlab.course.training.throughput import flops_per_token, gpu_peak_flops, matmul_params, mfu, throughput_line
    config = TrainConfig(**TINY).model_config()
    model = build_model(config, device="cpu")
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert matmul_params(config) == sum(w.numel() for w in weights)          # blocks' matrices and the head
    L, d, T = config.n_layers, config.d_model, config.seq_len
    assert flops_per_token(config) == 6 * matmul_params(config) + 12 * L * d * T
    assert mfu(2e6, 3e9, 4, 1e15) == pytest.approx(2e6 * 3e9 / 4e15)
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and gpu_peak_flops("Tesla T4") is None
    with pytest.raises(ValueError, match="at least one GPU"):
        mfu(1.0, 1.0, 0, 1e12)
    single = SimpleNamespace(tokens_per_s=1000.0, world_size=1, device="cpu", device_name="")
    cpu = SimpleNamespace(tokens_per_s=1500.0, world_size=2, device="cpu", device_name="")
    assert throughput_line(cpu, single, config) == "tokens/s = 1.50 x one process"
    gpu = SimpleNamespace(tokens_per_s=4e6, world_size=2, device="cuda", device_name="NVIDIA H100 80GB HBM3")
    expected = 4e6 * flops_per_token(config) / (2 * 989e12)
    assert throughput_line(gpu, single, config) == (f"tokens/s = 4000.00 x one process; 2,000,000 tokens/s per GPU, "
                                                    f"MFU {expected:.1%} of the bf16 peak")
    other = SimpleNamespace(**{**vars(gpu), "device_name": "Tesla T4"})
    assert "peak of 'Tesla T4' unknown" in throughput_line(other, single, config)
