"""The sharded loader: each data-parallel rank reads a disjoint, deterministic slice of every global batch.

    loader = ShardedLoader(text.train, seq_len=64, batch_size=16, rank=r, world_size=N, seed=0)
    x, y = next(loader)                         # (16 / N, 64) on distlab.device(); y is x shifted by one
    state = loader.state_dict()                 # {"step": ..., ...}: part of every checkpoint
    ShardedLoader(..., rank=r2, world_size=M).load_state_dict(state)   # resumes on M ranks

The token stream is cut into W = (len - 1) // T windows of T + 1 tokens (x and its shifted target y).
Epoch e visits every window once, in the order `torch.randperm(W)` draws from seed + e; the global batch of
step s is rows s·B ... s·B + B - 1 of that endless sequence (an epoch boundary may fall inside a batch) and
rank r of N reads rows [r·B/N, (r+1)·B/N) of it — the same rows `split_batch` gives, so N ranks together
read exactly what one process reads, and the loss of N ranks averaged equals one process's loss on the
whole batch. The position is one integer, the step: it does not depend on N, so a checkpoint saved on 4
ranks resumes on 2. Everything here is a pure function of (step, rank, N, B, W, seed): no rank talks to
another to agree on data.
"""
from __future__ import annotations

import functools
from typing import Any

import torch


@functools.lru_cache(maxsize=8)
def epoch_order(n_windows: int, epoch: int, seed: int) -> torch.Tensor:
    """The order epoch `epoch` visits the `n_windows` windows in (a permutation, the same on every rank)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + epoch)
    return torch.randperm(n_windows, generator=g)


def global_rows(step: int, batch_size: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """The window ids of step `step`'s global batch (B of them, in row order)."""
    if n_windows < 1:
        raise ValueError("the token stream is shorter than one window: use a shorter seq_len or more text")
    g = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs, pos = g // n_windows, g % n_windows
    return torch.stack([epoch_order(n_windows, int(e), seed)[int(p)] for e, p in zip(epochs, pos)])


def rank_rows(step: int, rank: int, world_size: int, batch_size: int, n_windows: int, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s window ids at step `step`: its contiguous B/N rows of the global batch."""
    if batch_size % world_size:
        raise ValueError(f"the global batch of {batch_size} rows does not split over {world_size} ranks; "
                         f"use a multiple of {world_size}")
    per = batch_size // world_size
    return global_rows(step, batch_size, n_windows, seed)[rank * per:(rank + 1) * per]


def windows(tokens: torch.Tensor, ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) for window ids `ids`: rows of `seq_len` tokens and the same rows shifted by one (int64)."""
    # The corpus lives in host memory (it is data, not a model state): cut the rows there, then move them. One
    # slice per row, by Python ints: no index tensor meets the corpus, so the device audit sees no mix whether
    # the corpus was loaded on the rank or passed to launch() (a host tensor).
    rows = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in ids.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


class ShardedLoader:
    """An endless iterator over this rank's slices of the global batches (see the module's docstring)."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device: Any = None) -> None:
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed, self.device = rank, world_size, seed, device
        self.n_windows = (tokens.numel() - 1) // seq_len
        rank_rows(0, rank, world_size, batch_size, max(self.n_windows, 1), seed)   # a bad split fails here
        self.step = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = rank_rows(step, self.rank, self.world_size, self.batch_size, self.n_windows, self.seed)
        x, y = windows(self.tokens, ids, self.seq_len)
        return (x, y) if self.device is None else (x.to(self.device), y.to(self.device))

    def __iter__(self) -> "ShardedLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position (a global step, the same for every N) and what it means."""
        return {"step": self.step, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_windows": self.n_windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        for k in ("seed", "batch_size", "seq_len", "n_windows"):
            if int(state[k]) != mine[k]:
                raise ValueError(f"this checkpoint's loader had {k} = {state[k]}, this run has {mine[k]}: "
                                 "resuming would read other data; start with the same data settings")
        self.step = int(state["step"])


def validation_rows(n_windows: int, batches: int, batch_size: int) -> list[torch.Tensor]:
    """Fixed validation batches: `batches` x B window ids spread evenly over the stream (every run and
    every N evaluate the same rows; rank r takes its B/N rows of each, as in training)."""
    ids = torch.linspace(0, n_windows - 1, batches * batch_size).long()
    return list(ids.view(batches, batch_size))
