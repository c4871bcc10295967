"""tests/bench/markers.py: transaction commit markers read from a partition's log segments."""

from __future__ import annotations

import struct
from pathlib import Path

from tests.bench.markers import commit_times, visible_at

TRANSACTIONAL, CONTROL = 0x10, 0x20


def _varint(value: int) -> bytes:
    zigzag = (value << 1) ^ (value >> 63)
    out = b""
    while zigzag >= 0x80:
        out += bytes([zigzag & 0x7F | 0x80])
        zigzag >>= 7
    return out + bytes([zigzag])


def _batch(base_offset: int, timestamp_ms: int, attributes: int, key: bytes, value: bytes) -> bytes:
    """One record batch of one record, in Kafka's message format v2 (the CRC is not checked here)."""
    body = b"\x00" + _varint(0) + _varint(0) + _varint(len(key)) + key + _varint(len(value)) + value
    record = _varint(len(body) + 1) + body + _varint(0)  # no headers
    after_length = struct.pack(
        ">ibIhiqqqhii",
        0,  # partition leader epoch
        2,  # magic
        0,  # crc
        attributes,
        0,  # last offset delta
        timestamp_ms,
        timestamp_ms,
        7,  # producer id
        0,  # producer epoch
        -1,  # base sequence
        1,  # records
    )
    payload = after_length + record
    return struct.pack(">qi", base_offset, len(payload)) + payload


def _marker(kind: int) -> bytes:
    return struct.pack(">hh", 0, kind)  # version, type (0 abort, 1 commit)


def test_commit_markers_and_when_each_record_became_visible(tmp_path: Path) -> None:
    log = (
        _batch(0, 1_000, TRANSACTIONAL, b"k", b"a")
        + _batch(1, 1_020, TRANSACTIONAL | CONTROL, _marker(1), b"\x00\x00\x00\x00\x00\x00")
        + _batch(2, 1_030, TRANSACTIONAL, b"k", b"b")
        + _batch(3, 1_050, TRANSACTIONAL | CONTROL, _marker(0), b"\x00\x00\x00\x00\x00\x00")
        + _batch(4, 1_060, TRANSACTIONAL, b"k", b"c")
        + _batch(5, 1_090, TRANSACTIONAL | CONTROL, _marker(1), b"\x00\x00\x00\x00\x00\x00")
        + _batch(6, 1_100, TRANSACTIONAL, b"k", b"d")
    )
    # The broker may be writing the next batch: a partial one at the end is not read.
    (tmp_path / "00000000000000000000.log").write_bytes(log + _batch(7, 1_200, 0, b"k", b"e")[:20])

    commits = commit_times(tmp_path)

    assert commits == [(1, 1.02), (5, 1.09)]  # the abort is no commit
    records = {"m1": (0, 0, 0.9), "m2": (0, 4, 1.05), "m3": (0, 6, 1.1), "m4": (1, 0, 1.0)}
    assert visible_at(records, {0: commits}) == {"m1": 1.02, "m2": 1.09}
