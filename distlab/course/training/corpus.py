"""Real text on every machine, with no download: the Python standard library's own source.

    text = corpus()                     # Corpus: train and validation token streams, file list, size
    text.train.numel(), text.val.numel()
    tok = ByteTokenizer(); tok.decode(text.train[:80])

Every Python install carries its standard library as source (`sysconfig`'s `stdlib` path; on CPython 3.11
about 970 `.py` files and 14 MB, PSF-licensed). The course reads those files in sorted order, leaving out
tests (`test/`, `tests/`), installed packages (`site-packages`) and caches, and tokenises them as bytes:
vocabulary 256, nothing to train, the same on every machine. A file goes to validation when the CRC-32 of
its path (relative to the stdlib root) is 0 mod 20 (about 5 %): whole files, so no window straddles the
split, and the split does not depend on file order or size.

The token streams are cached as one uint8 file per (Python version, byte limit) under
`$DISTLAB_CACHE` (default `~/.cache/distlab`), written then renamed, so a second run loads them in
milliseconds. `max_bytes` keeps the first files of each side up to its share of that many bytes (quick mode: a
few hundred kB).
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP = frozenset({"test", "tests", "site-packages", "__pycache__", "idle_test"})
VAL_EVERY = 20
VOCAB = 256
FORMAT = 2   # bump when the selection or the split changes: old caches are then ignored


class ByteTokenizer:
    """Bytes as tokens: UTF-8 text -> ids in [0, 256). Lossless, needs no training, vocabulary 256."""

    vocab_size = VOCAB

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files, sorted by their path relative to `root`, tests left out."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIP.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative: str) -> bool:
    """A file's side of the split: by the CRC-32 of its relative path (about 1 in `VAL_EVERY` files)."""
    return zlib.crc32(relative.encode()) % VAL_EVERY == 0


@dataclass(frozen=True)
class Corpus:
    """Token streams (uint8 ids) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    files: int
    source: str
    fingerprint: str     # names the corpus: a checkpoint trained on another corpus is told apart

    @property
    def bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def _read(root: Path, max_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    # With a limit, each side fills its own share (1/VAL_EVERY for validation), in file order.
    train, val, n = bytearray(), bytearray(), 0
    budget = {True: max_bytes // VAL_EVERY, False: max_bytes - max_bytes // VAL_EVERY} if max_bytes else None
    for path in stdlib_files(root):
        side = is_validation(path.relative_to(root).as_posix())
        into = val if side else train
        if budget is not None:
            if len(train) >= budget[False] and len(val) >= budget[True]:
                break
            if len(into) >= budget[side]:
                continue
        into.extend(path.read_bytes())
        n += 1
    as_ids = lambda b: torch.frombuffer(b, dtype=torch.uint8).clone() if b else torch.zeros(0, dtype=torch.uint8)
    return as_ids(train), as_ids(val), n


def cache_dir() -> Path:
    return Path(os.environ.get("DISTLAB_CACHE") or Path.home() / ".cache" / "distlab")


def corpus(max_bytes: int | None = None, *, root: Path | None = None, cache: bool = True) -> Corpus:
    """The stdlib corpus, tokenised as bytes (first files up to `max_bytes`; all of it by default)."""
    root = root or stdlib_root()
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha1(f"{root}|{version}|{max_bytes}|{FORMAT}".encode()).hexdigest()[:12]
    path = cache_dir() / f"stdlib-{version}-{max_bytes or 'all'}-{key}.pt"
    if cache and path.exists():
        try:
            blob = torch.load(path, weights_only=True)
            return Corpus(blob["train"], blob["val"], int(blob["files"]), str(root), str(blob["fingerprint"]))
        except Exception:   # a cache from another torch or a damaged file: rebuild it
            pass
    train, val, files = _read(root, max_bytes)
    digest = hashlib.sha1(train.numpy().tobytes()).hexdigest()[:8] + hashlib.sha1(val.numpy().tobytes()).hexdigest()[:8]
    fingerprint = f"stdlib-{version}-{files}files-{digest}"
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"train": train, "val": val, "files": files, "fingerprint": fingerprint}, tmp)
        os.replace(tmp, path)   # write, then rename: a reader never sees half a file
    return Corpus(train, val, files, str(root), fingerprint)
