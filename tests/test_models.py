"""The course model and data are deterministic, and the reference trainer learns."""
import pytest
import torch

from distlab.course.models import (PRESETS, build_model, lm_loss, num_params, split_batch, synthetic_batch,
                            train_reference)


def test_same_seed_same_weights_different_seed_different():
    a, b, c = build_model("tiny", seed=3), build_model("tiny", seed=3), build_model("tiny", seed=4)
    for (na, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), na
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_batches_are_deterministic_and_split_by_rows():
    cfg = PRESETS["tiny"]
    x, y = synthetic_batch(5, 8, cfg, seed=1)
    x2, _ = synthetic_batch(5, 8, cfg, seed=1)
    assert torch.equal(x, x2) and x.shape == (8, cfg.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert not torch.equal(x, synthetic_batch(6, 8, cfg, seed=1)[0])
    parts = [split_batch((x, y), r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    with pytest.raises(ValueError, match="does not split evenly"):
        split_batch((x, y), 0, 3)


def test_tied_weights_count_once():
    untied, tied = build_model("tiny"), build_model("tiny", tie_weights=True)
    cfg = untied.config
    assert num_params(untied) - num_params(tied) == cfg.vocab_size * cfg.d_model
    assert tied.head.weight is tied.tok.weight


def test_presets_sizes():
    assert num_params(build_model("tiny")) < 100_000
    assert num_params(build_model("medium")) >= 10_000_000


def test_reference_trainer_learns_and_is_reproducible():
    r1 = train_reference("tiny", steps=15, batch_size=8, lr=1e-2)
    r2 = train_reference("tiny", steps=15, batch_size=8, lr=1e-2)
    assert r1.losses == r2.losses
    assert r1.losses[-1] < 0.85 * r1.losses[0]
    x, y = synthetic_batch(0, 4, PRESETS["tiny"])
    loss = lm_loss(build_model("tiny"), x, y)
    assert loss.shape == () and loss.item() == pytest.approx(torch.log(torch.tensor(128.0)).item(), rel=0.1)
