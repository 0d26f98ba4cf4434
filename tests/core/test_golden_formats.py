"""Golden bytes for both RFC wire formats, written by hand from the RFC, never by the encoder.

Every hex literal below was assembled field by field from "Manifest Format" and "Data Batch
Format" (little-endian); the comments name each field so a reader can check them against the
RFC without running anything.
"""

from __future__ import annotations

import zstandard

from millpond.formats.batch import CompressionType, decode_batch, encode_batch
from millpond.formats.manifest import (
    Footer,
    ManifestEntry,
    Metadata,
    PendingEntry,
    append_entries,
    decode_footer,
    decode_manifest,
    empty_manifest,
    encode_entry,
    remove_through,
    with_epoch,
)


def _hex(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts).replace(" ", ""))


# The RFC's empty manifest: the 22-byte footer alone.
EMPTY_MANIFEST = _hex(
    "00000000",  # entry_count u32 = 0
    "0000000000000000",  # next_sequence u64 = 0
    "0000000000000000",  # epoch u64 = 0
    "0100",  # version u16 = 1
)

# entry 0: sequence 5, location "a/1", one metadata item (0, 1000 ms, b"x").
# entry_len = 8 + 2 + 3 + 4 + (4 + 8 + 4 + 1) = 34 = 0x22
ENTRY_0 = _hex(
    "22000000",  # entry_len u32 = 34
    "0500000000000000",  # sequence u64 = 5
    "0300",  # location_len u16 = 3
    "612f31",  # location "a/1"
    "01000000",  # metadata_count u32 = 1
    "00000000",  # start_index u32 = 0
    "e803000000000000",  # ingestion_time_ms i64 = 1000
    "01000000",  # payload_len u32 = 1
    "78",  # payload "x"
)
# entry 1: sequence 6, location "a/2", two items: (0, 1001 ms, b"") and (2, -1 ms, b"yz").
# entry_len = 8 + 2 + 3 + 4 + (4 + 8 + 4 + 0) + (4 + 8 + 4 + 2) = 51 = 0x33
ENTRY_1 = _hex(
    "33000000",  # entry_len u32 = 51
    "0600000000000000",  # sequence u64 = 6
    "0300",  # location_len u16 = 3
    "612f32",  # location "a/2"
    "02000000",  # metadata_count u32 = 2
    "00000000",  # start_index u32 = 0
    "e903000000000000",  # ingestion_time_ms i64 = 1001
    "00000000",  # payload_len u32 = 0
    "02000000",  # start_index u32 = 2
    "ffffffffffffffff",  # ingestion_time_ms i64 = -1
    "02000000",  # payload_len u32 = 2
    "797a",  # payload "yz"
)
TWO_ENTRY_FOOTER = _hex(
    "02000000",  # entry_count u32 = 2
    "0700000000000000",  # next_sequence u64 = 7
    "0300000000000000",  # epoch u64 = 3
    "0100",  # version u16 = 1
)
TWO_ENTRY_MANIFEST = ENTRY_0 + ENTRY_1 + TWO_ENTRY_FOOTER
TWO_ENTRIES = (
    ManifestEntry(5, "a/1", (Metadata(0, 1000, b"x"),)),
    ManifestEntry(6, "a/2", (Metadata(0, 1001, b""), Metadata(2, -1, b"yz"))),
)

# Uncompressed batch of records b"hi", b"", b"abc".
PLAIN_BATCH = _hex(
    "02000000",  # record 0 len u32 = 2
    "6869",  # "hi"
    "00000000",  # record 1 len u32 = 0
    "03000000",  # record 2 len u32 = 3
    "616263",  # "abc"
    "00",  # compression_type u8 = 0 (none)
    "03000000",  # record_count u32 = 3
    "0100",  # version u16 = 1
)

# The record block of b"hello", b"z": 14 bytes.
ZSTD_RECORD_BLOCK = _hex("05000000", "68656c6c6f", "01000000", "7a")
# A zstd frame written by hand (RFC 8878): one raw block holding the record block.
ZSTD_FRAME = (
    _hex(
        "28b52ffd",  # magic number
        "20",  # frame header descriptor: single segment, 1-byte content size, no checksum
        "0e",  # frame content size = 14
        "710000",  # block header: last block, raw, size 14 -> (14 << 3) | 1 = 0x71
    )
    + ZSTD_RECORD_BLOCK
)
ZSTD_BATCH = ZSTD_FRAME + _hex(
    "01",  # compression_type u8 = 1 (zstd)
    "02000000",  # record_count u32 = 2
    "0100",  # version u16 = 1
)


def test_empty_manifest_is_the_22_byte_footer() -> None:
    assert len(EMPTY_MANIFEST) == 22
    assert empty_manifest() == EMPTY_MANIFEST
    manifest = decode_manifest(EMPTY_MANIFEST)
    assert manifest.entries == ()
    assert manifest.footer == Footer(entry_count=0, next_sequence=0, epoch=0, version=1)
    assert manifest.first_sequence is None


def test_two_entry_manifest_decodes_to_the_rfc_fields() -> None:
    manifest = decode_manifest(TWO_ENTRY_MANIFEST)
    assert manifest.entries == TWO_ENTRIES
    assert manifest.footer == Footer(entry_count=2, next_sequence=7, epoch=3)
    assert manifest.first_sequence == 5


def test_encoder_writes_the_golden_entries() -> None:
    assert encode_entry(5, PendingEntry("a/1", TWO_ENTRIES[0].metadata)) == ENTRY_0
    assert encode_entry(6, PendingEntry("a/2", TWO_ENTRIES[1].metadata)) == ENTRY_1


def test_append_to_golden_manifest_produces_golden_bytes() -> None:
    # Start from the empty manifest at next_sequence 5, epoch 3, then append both entries.
    start = _hex("00000000", "0500000000000000", "0300000000000000", "0100")
    assert empty_manifest(epoch=3, next_sequence=5) == start
    pending = [PendingEntry(e.location, e.metadata) for e in TWO_ENTRIES]
    data, sequences = append_entries(start, pending)
    assert data == TWO_ENTRY_MANIFEST
    assert sequences == range(5, 7)
    # One at a time gives the same bytes as one group.
    one, _ = append_entries(start, pending[:1])
    two, seq_two = append_entries(one, pending[1:])
    assert two == TWO_ENTRY_MANIFEST
    assert seq_two == range(6, 7)


def test_remove_through_and_with_epoch_golden() -> None:
    data, removed = remove_through(TWO_ENTRY_MANIFEST, 5)
    assert removed == 1
    assert data == ENTRY_1 + _hex("01000000", "0700000000000000", "0300000000000000", "0100")
    data, removed = remove_through(TWO_ENTRY_MANIFEST, 6)
    assert removed == 2
    # next_sequence never goes back: the empty queue remembers 7.
    assert data == _hex("00000000", "0700000000000000", "0300000000000000", "0100")
    unchanged, removed = remove_through(TWO_ENTRY_MANIFEST, 4)
    assert (unchanged, removed) == (TWO_ENTRY_MANIFEST, 0)
    bumped = with_epoch(TWO_ENTRY_MANIFEST, 4)
    assert bumped == ENTRY_0 + ENTRY_1 + _hex(
        "02000000", "0700000000000000", "0400000000000000", "0100"
    )


def test_plain_batch_golden() -> None:
    assert decode_batch(PLAIN_BATCH) == [b"hi", b"", b"abc"]
    assert encode_batch([b"hi", b"", b"abc"]) == PLAIN_BATCH


def test_empty_batch_is_the_7_byte_footer() -> None:
    footer_only = _hex("00", "00000000", "0100")
    assert decode_batch(footer_only) == []
    assert encode_batch([]) == footer_only


def test_hand_written_zstd_batch_decodes() -> None:
    assert decode_batch(ZSTD_BATCH) == [b"hello", b"z"]


def test_zstd_encoder_compresses_the_record_block_at_level_3() -> None:
    encoded = encode_batch([b"hello", b"z"], CompressionType.ZSTD)
    footer = _hex("01", "02000000", "0100")
    assert encoded.endswith(footer)
    frame = encoded[: -len(footer)]
    assert zstandard.ZstdDecompressor().decompress(frame) == ZSTD_RECORD_BLOCK
    assert frame == zstandard.ZstdCompressor(level=3).compress(ZSTD_RECORD_BLOCK)


def test_batch_round_trips() -> None:
    records = [b"", b"\x00" * 1000, bytes(range(256)), b"tail"]
    for compression in CompressionType:
        assert decode_batch(encode_batch(records, compression)) == records


def test_manifest_round_trip_through_footer() -> None:
    footer = decode_footer(TWO_ENTRY_MANIFEST)
    assert footer.encode() == TWO_ENTRY_FOOTER
