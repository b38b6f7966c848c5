"""Authenticated, ordered records on a byte stream (a pipe or a FIFO).

Two streams use it: the sandbox runner's results to the grader (keyed by a
secret only the grader and the runner hold), and each rank's audit events to
the runner (keyed per rank; see `distlab.grading.rankside`). A record is

    magic(4) | seq(8) | length(4) | payload | HMAC-SHA256(key, seq | length | payload)

`read_records` returns the records that verify, in order, and stops at the
first one that does not: a forged, replayed, reordered or truncated record
ends the stream there, and the caller learns why (`Stream.problem`). Nothing
a learner writes into such a stream without the key is ever believed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

MAGIC = b"DLG1"
_HEAD = struct.Struct(">4sQI")
TAG_BYTES = 32
MAX_RECORD = 512 << 20      # one record (a case's raw outputs for every rank)


def new_key() -> bytes:
    """A fresh random key (32 bytes)."""
    return os.urandom(32)


def _tag(key: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(key, _HEAD.pack(MAGIC, seq, len(payload))[4:] + payload, hashlib.sha256).digest()


def seal(key: bytes, seq: int, payload: bytes) -> bytes:
    """One record: `payload` as the `seq`-th record of a stream keyed by `key`."""
    return _HEAD.pack(MAGIC, seq, len(payload)) + payload + _tag(key, seq, payload)


class Writer:
    """Writes sealed records to a file descriptor, numbering them from 0."""

    def __init__(self, fd: int, key: bytes) -> None:
        self.fd, self._key, self.seq = fd, key, 0

    def send(self, payload: bytes) -> None:
        data = memoryview(seal(self._key, self.seq, payload))
        self.seq += 1
        while data:
            n = os.write(self.fd, data)
            data = data[n:]


@dataclass
class Stream:
    """What a stream held: the verified payloads, in order, and why it stopped early (if it did)."""

    records: list[bytes] = field(default_factory=list)
    problem: str = ""          # "" when every byte belonged to a verified record


def read_records(data: bytes, key: bytes, *, max_records: int = 1_000_000) -> Stream:
    """Verify and split `data` (a whole stream) into records; see the module docstring."""
    out = Stream()
    pos, seq = 0, 0
    while pos < len(data):
        if len(out.records) >= max_records:
            out.problem = f"more than {max_records} records"
            return out
        if len(data) - pos < _HEAD.size:
            out.problem = "the stream ends inside a record"
            return out
        magic, got_seq, length = _HEAD.unpack_from(data, pos)
        if magic != MAGIC:
            out.problem = f"bytes that are not a record at offset {pos}"
            return out
        end = pos + _HEAD.size + length + TAG_BYTES
        if length > MAX_RECORD or end > len(data):
            out.problem = "the stream ends inside a record"
            return out
        payload = data[pos + _HEAD.size: pos + _HEAD.size + length]
        if not hmac.compare_digest(data[end - TAG_BYTES: end], _tag(key, got_seq, payload)):
            out.problem = f"record {got_seq} does not verify (forged or corrupted)"
            return out
        if got_seq != seq:
            out.problem = f"record {got_seq} arrived where record {seq} was due (replayed, reordered or dropped)"
            return out
        out.records.append(payload)
        pos, seq = end, seq + 1
    return out
