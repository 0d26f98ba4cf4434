"""The data batch wire format, version 1 (OpenData RFC 0001, "Data Batch Format").

Pure functions over bytes. Layout, little-endian::

    record block := ([len u32][data])*          -- optionally compressed as one unit
    footer       := compression_type u8 | record_count u32 | version u16   (7 bytes)

Compression type 0 is none, 1 is Zstandard at level 3; every other value is reserved and
rejected.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

import zstandard

from millpond.errors import FormatError, InvalidInputError

__all__ = [
    "BATCH_FOOTER_SIZE",
    "BATCH_VERSION",
    "MAX_RECORD_BYTES",
    "CompressionType",
    "decode_batch",
    "encode_batch",
]

BATCH_VERSION = 1
_FOOTER = struct.Struct("<BIH")
_U32 = struct.Struct("<I")
BATCH_FOOTER_SIZE = _FOOTER.size  # 7
MAX_RECORD_BYTES = 0xFFFF_FFFF
ZSTD_LEVEL = 3
# A decompressed record block larger than this is refused rather than allocated: a corrupt or
# hostile frame must not be able to exhaust memory.
MAX_BLOCK_BYTES = 8 << 30
_CHUNK = 1 << 20


class CompressionType(IntEnum):
    """How the record block of a batch is compressed."""

    NONE = 0
    ZSTD = 1

    @classmethod
    def parse(cls, value: str | int | CompressionType) -> CompressionType:
        """Accept ``"none"``/``"zstd"`` or the wire value.

        Raises:
            InvalidInputError: an unknown name or value.
        """
        if isinstance(value, CompressionType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                pass
        raise InvalidInputError(f"compression: expected 'none' or 'zstd', found {value!r}")


def encode_batch(
    records: Sequence[bytes | bytearray | memoryview],
    compression: CompressionType = CompressionType.NONE,
) -> bytes:
    """Encode records as a v1 batch.

    Raises:
        InvalidInputError: a record over the u32 limit or more records than u32 counts.
    """
    if len(records) > MAX_RECORD_BYTES:
        raise InvalidInputError(
            f"record_count: expected at most {MAX_RECORD_BYTES}, found {len(records)}"
        )
    parts: list[bytes | bytearray | memoryview] = []
    for record in records:
        size = len(record)
        if size > MAX_RECORD_BYTES:
            raise InvalidInputError(
                f"record: expected at most {MAX_RECORD_BYTES} bytes, found {size}"
            )
        parts.append(_U32.pack(size))
        parts.append(record)
    footer = _FOOTER.pack(int(compression), len(records), BATCH_VERSION)
    if compression is CompressionType.ZSTD:
        block = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(parts))
        return block + footer
    # One copy of the payload, not two: ``block + footer`` would copy the whole block again.
    parts.append(footer)
    return b"".join(parts)


def decode_batch(raw: bytes | memoryview, *, name: str = "batch") -> list[bytes]:
    """Decode and validate a v1 batch.

    Raises:
        FormatError: naming the object, field and byte offset of what is wrong.
    """
    if len(raw) < BATCH_FOOTER_SIZE:
        raise FormatError(
            f"{name}: footer at byte 0: expected at least {BATCH_FOOTER_SIZE} bytes, "
            f"found {len(raw)}",
            field="footer",
            offset=0,
        )
    footer_at = len(raw) - BATCH_FOOTER_SIZE
    compression, record_count, version = _FOOTER.unpack_from(raw, footer_at)
    if version != BATCH_VERSION:
        raise FormatError(
            f"{name}: version at byte {footer_at + 5}: expected {BATCH_VERSION}, found {version}",
            field="version",
            offset=footer_at + 5,
        )
    block = memoryview(raw)[:footer_at]
    if compression == CompressionType.ZSTD:
        block = memoryview(_decompress(block, name))
    elif compression != CompressionType.NONE:
        raise FormatError(
            f"{name}: compression_type at byte {footer_at}: expected 0 (none) or 1 (zstd), "
            f"found {compression}",
            field="compression_type",
            offset=footer_at,
        )
    return _split_records(
        block, record_count, name, compressed=compression != 0, count_at=footer_at + 1
    )


def _decompress(block: memoryview, name: str) -> bytes:
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    out: list[bytes] = []
    total = 0
    try:
        for start in range(0, len(block), _CHUNK):
            chunk = decompressor.decompress(block[start : start + _CHUNK])
            total += len(chunk)
            if total > MAX_BLOCK_BYTES:
                raise FormatError(
                    f"{name}: record block at byte 0: decompresses past {MAX_BLOCK_BYTES} bytes",
                    field="record_block",
                    offset=0,
                )
            out.append(chunk)
    except zstandard.ZstdError as err:
        raise FormatError(
            f"{name}: record block at byte 0: invalid zstd data ({err})",
            field="record_block",
            offset=0,
        ) from err
    if not decompressor.eof:
        raise FormatError(
            f"{name}: record block at byte {len(block)}: zstd frame is truncated",
            field="record_block",
            offset=len(block),
        )
    if decompressor.unused_data:
        at = len(block) - len(decompressor.unused_data)
        raise FormatError(
            f"{name}: record block at byte {at}: {len(decompressor.unused_data)} bytes after "
            "the zstd frame",
            field="record_block",
            offset=at,
        )
    return b"".join(out)


def _split_records(
    block: memoryview, record_count: int, name: str, *, compressed: bool, count_at: int
) -> list[bytes]:
    where = " (decompressed)" if compressed else ""
    # Each record needs at least its 4-byte length: bound the count by the bytes present.
    if record_count * 4 > len(block):
        raise FormatError(
            f"{name}: record_count at byte {count_at}: {record_count} records cannot fit in "
            f"{len(block)} bytes{where}",
            field="record_count",
            offset=count_at,
        )
    records: list[bytes] = []
    offset = 0
    end = len(block)
    for index in range(record_count):
        if end - offset < 4:
            raise FormatError(
                f"{name}: record {index} len at byte {offset}{where}: expected 4 bytes, "
                f"found {end - offset}",
                field="len",
                offset=offset,
            )
        (size,) = _U32.unpack_from(block, offset)
        offset += 4
        if size > end - offset:
            raise FormatError(
                f"{name}: record {index} len at byte {offset - 4}{where}: {size} runs past "
                f"the record block ({end - offset} bytes left)",
                field="len",
                offset=offset - 4,
            )
        records.append(bytes(block[offset : offset + size]))
        offset += size
    if offset != end:
        raise FormatError(
            f"{name}: record_count at byte {count_at}: {record_count} records end at byte "
            f"{offset}{where}, the record block has {end} bytes",
            field="record_count",
            offset=count_at,
        )
    return records
