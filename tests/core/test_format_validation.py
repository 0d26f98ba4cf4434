"""Decoders validate every length and count and name the field and byte offset of the fault.

One test per field. Inputs are built from the hand-written golden bytes by patching one field,
so each test states exactly which byte is wrong and where.
"""

from __future__ import annotations

import struct

import pytest

from millpond.errors import FormatError, InvalidInputError
from millpond.formats import manifest as manifest_format
from millpond.formats.batch import decode_batch
from millpond.formats.manifest import (
    Metadata,
    PendingEntry,
    append_entries,
    decode_manifest,
    empty_manifest,
    encode_entry,
    find_locations,
    remove_through,
)

from .test_golden_formats import (
    ENTRY_0,
    ENTRY_1,
    PLAIN_BATCH,
    TWO_ENTRY_MANIFEST,
    ZSTD_FRAME,
    ZSTD_RECORD_BLOCK,
    _hex,
)

# Offsets inside the golden two-entry manifest (entry 0 is 38 bytes, entry 1 is 55).
E1 = len(ENTRY_0)  # start of entry 1
BODY_END = len(ENTRY_0) + len(ENTRY_1)  # start of the footer


def _patch(raw: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _footer(entry_count: int, next_sequence: int, epoch: int = 0, version: int = 1) -> bytes:
    return struct.pack("<IQQH", entry_count, next_sequence, epoch, version)


def _manifest_error(raw: bytes) -> FormatError:
    with pytest.raises(FormatError) as info:
        decode_manifest(raw, name="ingest/manifest")
    err = info.value
    assert "ingest/manifest" in str(err)
    assert f"at byte {err.offset}" in str(err)
    return err


def _batch_error(raw: bytes) -> FormatError:
    with pytest.raises(FormatError) as info:
        decode_batch(raw, name="ingest/X.batch")
    assert "ingest/X.batch" in str(info.value)
    return info.value


# --- manifest -----------------------------------------------------------------------------


def test_manifest_shorter_than_footer() -> None:
    err = _manifest_error(b"\x00" * 21)
    assert (err.field, err.offset) == ("footer", 0)
    assert "expected at least 22 bytes, found 21" in str(err)


def test_manifest_unknown_version() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END + 20, "<H", 2)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("version", BODY_END + 20)
    assert "expected 1, found 2" in str(err)


def test_manifest_version_zero_on_empty() -> None:
    err = _manifest_error(_footer(0, 0, version=0))
    assert (err.field, err.offset) == ("version", 20)


def test_manifest_entry_count_larger_than_bytes_can_hold() -> None:
    err = _manifest_error(_footer(1, 1))
    assert (err.field, err.offset) == ("entry_count", 0)
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END, "<I", 0xFFFF_FFFF)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_count", BODY_END)


def test_manifest_entry_count_differs_from_entries_found() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END, "<I", 1)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_count", BODY_END)
    assert "expected 2 (entries found), found 1" in str(err)
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END, "<I", 3)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_count", BODY_END)


def test_manifest_entry_len_past_the_footer() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, E1, "<I", len(ENTRY_1))  # 4 bytes too long
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_len", E1)


def test_manifest_entry_len_shorter_than_its_location() -> None:
    # entry_len 16 cannot hold 8 + 2 + location_len 3 + 4.
    raw = _patch(TWO_ENTRY_MANIFEST, 0, "<I", 16)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_len", 0)


def test_manifest_entry_len_longer_than_its_fields() -> None:
    # Entry 0 claims 38 bytes but its fields end after 34: the framing fits the body (the
    # extra 4 bytes are borrowed from entry 1), so the field walk is what catches it.
    raw = _patch(TWO_ENTRY_MANIFEST, 0, "<I", 38)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_len", 0)
    # A lone entry with 4 bytes of slack after its last payload.
    lone = _patch(ENTRY_0, 0, "<I", 38) + b"\x00" * 4 + _footer(1, 6)
    err = _manifest_error(lone)
    assert (err.field, err.offset) == ("entry_len", 0)
    assert "fields end at byte 38, entry_len says 42" in str(err)


def test_manifest_trailing_bytes_too_short_for_an_entry() -> None:
    raw = TWO_ENTRY_MANIFEST[:BODY_END] + b"\x00" * 5 + TWO_ENTRY_MANIFEST[BODY_END:]
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_len", BODY_END)


def test_manifest_location_not_utf8() -> None:
    raw = bytearray(TWO_ENTRY_MANIFEST)
    raw[14] = 0xFF  # first location byte of entry 0
    err = _manifest_error(bytes(raw))
    assert (err.field, err.offset) == ("location", 14)


def test_manifest_metadata_count_cannot_fit() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, 17, "<I", 2)  # entry 0 holds one item's bytes
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("metadata_count", 17)


def test_manifest_metadata_count_runs_out_mid_entry() -> None:
    # Entry 1 has two items (16 + 18 bytes). Claim three: 3 * 16 = 48 > 34 bytes left.
    raw = _patch(TWO_ENTRY_MANIFEST, E1 + 17, "<I", 3)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("metadata_count", E1 + 17)


def test_manifest_metadata_count_too_small() -> None:
    # Entry 1 says one item but holds two: the fields end before entry_len does.
    raw = _patch(TWO_ENTRY_MANIFEST, E1 + 17, "<I", 1)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("entry_len", E1)


def test_manifest_payload_len_past_entry_end() -> None:
    # payload_len of entry 0's only item sits at 17 + 4 + 4 + 8 = 33.
    raw = _patch(TWO_ENTRY_MANIFEST, 33, "<I", 2)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("payload_len", 33)


def test_manifest_payload_len_leaves_no_room_for_next_item() -> None:
    # Entry 1's first item payload_len (at E1 + 21 + 12) grows from 0 to 3: the payload
    # now swallows the start of the second item, whose 16-byte header no longer fits.
    raw = _patch(TWO_ENTRY_MANIFEST, E1 + 33, "<I", 3)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("metadata_count", E1 + 37 + 3)


def test_manifest_sequences_not_contiguous() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, E1 + 4, "<Q", 7)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("sequence", E1 + 4)
    assert "expected 6 (contiguous), found 7" in str(err)


def test_manifest_next_sequence_not_one_past_last() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END + 4, "<Q", 9)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("next_sequence", BODY_END + 4)
    raw = _patch(TWO_ENTRY_MANIFEST, BODY_END + 4, "<Q", 6)
    err = _manifest_error(raw)
    assert (err.field, err.offset) == ("next_sequence", BODY_END + 4)


def test_manifest_framing_errors_also_raised_by_remove_and_find() -> None:
    raw = _patch(TWO_ENTRY_MANIFEST, E1, "<I", len(ENTRY_1))
    with pytest.raises(FormatError):
        remove_through(raw, 10)
    with pytest.raises(FormatError):
        find_locations(raw, {"a/2"})


# --- what the encoder refuses (InvalidInputError, nothing written) -------------------------


@pytest.mark.parametrize(
    ("sequence", "entry", "field"),
    [
        (0, PendingEntry(""), "location"),
        (0, PendingEntry("x" * 0x10000), "location"),
        (-1, PendingEntry("a"), "sequence"),
        (1 << 64, PendingEntry("a"), "sequence"),
        (0, PendingEntry("a", (Metadata(-1, 0),)), "start_index"),
        (0, PendingEntry("a", (Metadata(1 << 32, 0),)), "start_index"),
        (0, PendingEntry("a", (Metadata(0, 1 << 63),)), "ingestion_time_ms"),
    ],
)
def test_encode_entry_rejects_out_of_range(sequence: int, entry: PendingEntry, field: str) -> None:
    with pytest.raises(InvalidInputError, match=field):
        encode_entry(sequence, entry)


def test_longest_location_is_accepted() -> None:
    encoded = encode_entry(0, PendingEntry("x" * 0xFFFF))
    data, _ = append_entries(empty_manifest(), [PendingEntry("x" * 0xFFFF)])
    assert decode_manifest(data).entries[0].location == "x" * 0xFFFF
    assert len(encoded) == 4 + 8 + 2 + 0xFFFF + 4


def test_append_rejects_next_sequence_overflow() -> None:
    top = empty_manifest(next_sequence=(1 << 64) - 1)
    with pytest.raises(InvalidInputError, match="next_sequence"):
        append_entries(top, [PendingEntry("a")])


# --- appending never decodes existing entries ----------------------------------------------


def test_append_keeps_garbage_but_framed_entries_byte_for_byte() -> None:
    garbage = bytes([0xFF]) * 40  # not a decodable entry, but the footer is valid
    raw = garbage + _footer(1, 9, epoch=4)
    with pytest.raises(FormatError):
        decode_manifest(raw)
    data, sequences = append_entries(raw, [PendingEntry("b/1")])
    assert sequences == range(9, 10)
    assert data.startswith(garbage)
    assert data.endswith(_footer(2, 10, epoch=4))
    assert data[len(garbage) : -22] == encode_entry(9, PendingEntry("b/1"))


def test_append_never_calls_the_entry_decoders(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("append decoded an existing entry")

    monkeypatch.setattr(manifest_format, "_decode_entry", refuse)
    monkeypatch.setattr(manifest_format, "_entry_spans", refuse)
    monkeypatch.setattr(manifest_format, "decode_manifest", refuse)
    data, sequences = append_entries(TWO_ENTRY_MANIFEST, [PendingEntry("a/3")])
    assert sequences == range(7, 8)
    assert data.startswith(ENTRY_0 + ENTRY_1)


# --- batch ---------------------------------------------------------------------------------

PLAIN_FOOTER_AT = len(PLAIN_BATCH) - 7


def test_batch_shorter_than_footer() -> None:
    err = _batch_error(b"\x00\x01\x00")
    assert (err.field, err.offset) == ("footer", 0)


def test_batch_unknown_version() -> None:
    raw = _patch(PLAIN_BATCH, PLAIN_FOOTER_AT + 5, "<H", 7)
    err = _batch_error(raw)
    assert (err.field, err.offset) == ("version", PLAIN_FOOTER_AT + 5)
    assert "expected 1, found 7" in str(err)


@pytest.mark.parametrize("compression", [2, 3, 0x7F, 0xFF])
def test_batch_reserved_compression_type(compression: int) -> None:
    raw = _patch(PLAIN_BATCH, PLAIN_FOOTER_AT, "<B", compression)
    err = _batch_error(raw)
    assert (err.field, err.offset) == ("compression_type", PLAIN_FOOTER_AT)
    assert f"found {compression}" in str(err)


def test_batch_record_count_larger_than_block_can_hold() -> None:
    raw = _patch(PLAIN_BATCH, PLAIN_FOOTER_AT + 1, "<I", 1000)
    err = _batch_error(raw)
    assert err.field == "record_count"
    assert err.offset == PLAIN_FOOTER_AT + 1


def test_batch_record_count_smaller_than_records_present() -> None:
    raw = _patch(PLAIN_BATCH, PLAIN_FOOTER_AT + 1, "<I", 2)
    err = _batch_error(raw)
    assert (err.field, err.offset) == ("record_count", PLAIN_FOOTER_AT + 1)
    assert "2 records end at byte 10, the record block has 17 bytes" in str(err)


def test_batch_record_len_past_block_end() -> None:
    raw = _patch(PLAIN_BATCH, 10, "<I", 4)  # record 2 claims 4 bytes, 3 are left
    err = _batch_error(raw)
    assert (err.field, err.offset) == ("len", 10)
    assert "record 2" in str(err)


def test_batch_record_len_field_truncated() -> None:
    # Two records claimed; after the first only one byte is left for the second's length.
    block = _hex("03000000", "616263", "00")
    err = _batch_error(block + _hex("00", "02000000", "0100"))
    assert (err.field, err.offset) == ("len", 7)


def test_batch_zstd_not_a_frame() -> None:
    err = _batch_error(ZSTD_RECORD_BLOCK + _hex("01", "02000000", "0100"))
    assert err.field == "record_block"
    assert err.offset == 0


def test_batch_zstd_frame_truncated() -> None:
    frame = ZSTD_FRAME[:-3]
    err = _batch_error(frame + _hex("01", "02000000", "0100"))
    assert err.field == "record_block"
    assert err.offset == len(frame)


def test_batch_zstd_bytes_after_frame() -> None:
    err = _batch_error(ZSTD_FRAME + b"\xaa\xbb" + _hex("01", "02000000", "0100"))
    assert (err.field, err.offset) == ("record_block", len(ZSTD_FRAME))


@pytest.mark.parametrize("record_count", [1, 5])
def test_batch_zstd_record_count_checked_after_decompression(record_count: int) -> None:
    # The decompressed block holds 2 records in 14 bytes: 1 leaves bytes over, 5 cannot fit.
    footer_at = len(ZSTD_FRAME)
    raw = ZSTD_FRAME + _hex("01") + struct.pack("<I", record_count) + _hex("0100")
    err = _batch_error(raw)
    assert (err.field, err.offset) == ("record_count", footer_at + 1)
    assert "(decompressed)" in str(err)
