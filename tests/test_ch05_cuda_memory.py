"""Chapter 5's "between steps a rank holds only its shard" on GPU-style memory counters (issue 23, #5).

CUDA's allocator counters see every free, also of tensors made before the meter started; the CPU meter
books only storages born inside it. On the strict backend the CPU meter books as CUDA does, so a check that
builds its model outside the meter (the 4 bytes per element ZeRO-3 frees when it shards would then show
as "minus") fails here as it would on a GPU. The check builds the model inside the meter: it passes both ways.
"""
from __future__ import annotations

import torch

import distlab
from distlab.meters import track_memory
from labkit import answers
from test_ch05_zero3 import LAB, _case


def _freed_inside():
    made_before = torch.ones(1000, device=distlab.device())
    with track_memory() as mem:
        fresh = made_before * 2          # born inside: +4000 B
        del made_before                  # made before, freed inside: CUDA's counters say -4000 B
    return mem.current_bytes, fresh.numel()


def test_strict_memory_meter_books_frees_as_cuda_counters_do(no_orphans):
    assert distlab.launch(_freed_inside, 1, strict=False) == [(4000, 1000)]
    assert distlab.launch(_freed_inside, 1, strict=True) == [(0, 1000)]


def test_zero3_holds_only_its_shard_on_gpu_style_counters(no_orphans, monkeypatch):
    monkeypatch.setenv("DISTLAB_STRICT", "1")
    out = _case("train", answers(LAB), 2)
    assert out[3].startswith("PASS train, 2 ranks: between steps a rank holds only its shard"), out
