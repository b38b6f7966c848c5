"""The data-parallel chapters' helpers, without ranks: sweeps on one backend, batches for any N,
the test models, the Bucket container."""
from __future__ import annotations

import importlib

import pytest
import torch

from distlab.course.data_parallel.ddp import Bucket
from distlab.course.data_parallel.measure import backend_for, global_batch, ranks_label, sweep_world_sizes
from distlab.course.data_parallel.reference import full_batch_gradient, make_model, trainable


@pytest.mark.parametrize("gpus, n_max, want", [
    (0, 4, [1, 2, 4]), (0, 1, [1]), (0, 3, [1, 2, 3]), (0, 8, [1, 2, 4, 8]), (0, 6, [1, 2, 4, 6]),
    (8, 8, [1, 2, 4, 8]), (1, 1, [1]),
    (2, 4, [4]),           # 1 and 2 ranks would run on NCCL, 4 on gloo: keep the 4-rank point only
    (2, 2, [1, 2]), (3, 3, [1, 2, 3]),
])
def test_a_sweep_stays_on_one_backend(monkeypatch, gpus, n_max, want):
    monkeypatch.setattr(importlib.import_module("distlab.engine.launch"), "gpu_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    sizes = sweep_world_sizes(n_max)
    assert sizes == want
    assert len({backend_for(n) for n in sizes}) == 1
    assert ranks_label(n_max).endswith("with NCCL" if gpus >= n_max else "with gloo")


@pytest.mark.parametrize("sizes", [[1, 2, 4], [1], [1, 2, 3], [1, 2, 4, 6], [1, 2, 4, 7], [1, 2, 4, 8]])
def test_the_global_batch_splits_evenly_for_every_n(sizes):
    b = global_batch(sizes, target=16)
    assert b >= max(sizes) and all(b % n == 0 for n in sizes)


def test_the_test_models():
    frozen, tied = make_model("frozen", device="cpu"), make_model("tied", device="cpu")
    assert [k for k, _ in trainable(frozen)] == [k for k, p in frozen.named_parameters() if k != "pos.weight"]
    assert tied.head.weight is tied.tok.weight and "head.weight" not in dict(tied.named_parameters())
    assert make_model("tied", dtype=torch.bfloat16, device="cpu").tok.weight.dtype == torch.bfloat16
    g = full_batch_gradient("frozen", batch_size=4)
    assert g.shape == (sum(p.numel() for _, p in trainable(frozen)),)
    with pytest.raises(ValueError, match="unknown variant"):
        make_model("shared")


def test_a_bucket_lives_on_its_parameters_device_and_views_its_buffer():
    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))]
    b = Bucket(params)
    assert b.flat.shape == (10,) and b.flat.device == params[0].device and b.nbytes == 40
    b.views[1].fill_(2.0)
    assert b.flat[6:].tolist() == [2.0] * 4 and b.views[0].shape == (3, 2)
    assert Bucket(params, torch.bfloat16).flat.dtype == torch.bfloat16
