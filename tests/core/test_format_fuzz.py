"""Hypothesis fuzzing of both decoders: any input gives a value or a FormatError, quickly.

Inputs are random bytes, random bodies behind a valid footer (so decoding gets past the
footer checks), and valid encodings mutated by truncation, bit flips and splices. The
``deadline`` makes a slow example (a loop not bounded by the input) fail the test.
"""

from __future__ import annotations

import struct
from datetime import timedelta

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from millpond.errors import FormatError
from millpond.formats.batch import CompressionType, decode_batch, encode_batch
from millpond.formats.manifest import (
    Manifest,
    Metadata,
    PendingEntry,
    append_entries,
    decode_manifest,
    empty_manifest,
    find_locations,
    remove_through,
)

FUZZ = settings(
    max_examples=300,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow],
)

metadata_items = st.builds(
    Metadata,
    start_index=st.integers(0, 2**32 - 1),
    ingestion_time_ms=st.integers(-(2**63), 2**63 - 1),
    payload=st.binary(max_size=24),
)
pending_entries = st.builds(
    PendingEntry,
    location=st.text(min_size=1, max_size=12).filter(lambda s: 0 < len(s.encode()) < 0xFFFF),
    metadata=st.lists(metadata_items, max_size=3).map(tuple),
)


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    raw = empty_manifest(
        epoch=draw(st.integers(0, 2**64 - 1)), next_sequence=draw(st.integers(0, 2**40))
    )
    for group in draw(st.lists(st.lists(pending_entries, min_size=1, max_size=3), max_size=3)):
        raw, _ = append_entries(raw, group)
    return raw


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    records = draw(st.lists(st.binary(max_size=40), max_size=8))
    return encode_batch(records, draw(st.sampled_from(list(CompressionType))))


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["truncate_end", "truncate_start", "flip", "splice", "cut"]))
        if kind == "truncate_end":
            del data[draw(st.integers(0, len(data))) :]
        elif kind == "truncate_start":
            del data[: draw(st.integers(0, len(data)))]
        elif kind == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "splice":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "cut" and data:
            at = draw(st.integers(0, len(data) - 1))
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


def _valid_footer_after(body: bytes, entry_count: int, next_sequence: int) -> bytes:
    return body + struct.pack("<IQQH", entry_count, next_sequence, 0, 1)


def _check_error(err: FormatError) -> None:
    # Every rejection names its field, and its offset whenever it names a byte.
    assert err.field is not None
    assert err.offset is not None or "at byte" not in str(err)


def _check_manifest(raw: bytes) -> None:
    try:
        manifest = decode_manifest(raw)
    except FormatError as err:
        _check_error(err)
        return
    assert isinstance(manifest, Manifest)
    assert manifest.footer.entry_count == len(manifest.entries)
    # What decodes must also be walkable by the append-path helpers.
    remove_through(raw, manifest.next_sequence - 1)
    find_locations(raw, {e.location for e in manifest.entries})


def _check_batch(raw: bytes) -> None:
    try:
        records = decode_batch(raw)
    except FormatError as err:
        _check_error(err)
        return
    assert all(isinstance(r, bytes) for r in records)
    # record_count sits one byte into the footer.
    assert len(records) == struct.unpack_from("<I", raw, len(raw) - 6)[0]


@FUZZ
@given(st.binary(max_size=512))
@example(b"")
@example(b"\x00" * 22)
@example(b"\x00" * 7)
def test_decoders_on_random_bytes(raw: bytes) -> None:
    _check_manifest(raw)
    _check_batch(raw)


@FUZZ
@given(st.binary(max_size=256), st.integers(0, 20), st.integers(0, 2**64 - 1))
def test_manifest_decoder_on_random_body_behind_valid_footer(
    body: bytes, entry_count: int, next_sequence: int
) -> None:
    _check_manifest(_valid_footer_after(body, entry_count, next_sequence))


@FUZZ
@given(st.binary(max_size=256), st.integers(0, 20), st.sampled_from([0, 1]))
def test_batch_decoder_on_random_block_behind_valid_footer(
    block: bytes, record_count: int, compression: int
) -> None:
    _check_batch(block + struct.pack("<BIH", compression, record_count, 1))


@FUZZ
@given(mutated(manifests()))
def test_manifest_decoder_on_mutated_encodings(raw: bytes) -> None:
    _check_manifest(raw)


@FUZZ
@given(mutated(batches()))
def test_batch_decoder_on_mutated_encodings(raw: bytes) -> None:
    _check_batch(raw)


@FUZZ
@given(mutated(manifests()), st.integers(-1, 2**41))
def test_remove_and_find_on_mutated_encodings(raw: bytes, through: int) -> None:
    try:
        remove_through(raw, through)
        find_locations(raw, {"a", "b"}, from_sequence=0)
    except FormatError:
        pass


@FUZZ
@given(st.lists(st.lists(pending_entries, min_size=1, max_size=4), max_size=4), st.integers(0, 99))
def test_manifest_round_trip(groups: list[list[PendingEntry]], epoch: int) -> None:
    raw = empty_manifest(epoch=epoch)
    expected: list[PendingEntry] = []
    for group in groups:
        raw, sequences = append_entries(raw, group)
        assert sequences.start == len(expected)
        expected.extend(group)
    manifest = decode_manifest(raw)
    assert manifest.epoch == epoch
    assert manifest.next_sequence == len(expected)
    assert [(e.location, e.metadata) for e in manifest.entries] == [
        (p.location, p.metadata) for p in expected
    ]
    assert [e.sequence for e in manifest.entries] == list(range(len(expected)))


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=16), st.sampled_from(list(CompressionType)))
def test_batch_round_trip(records: list[bytes], compression: CompressionType) -> None:
    assert decode_batch(encode_batch(records, compression)) == records
