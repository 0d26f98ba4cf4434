"""The local write-ahead log's byte layout: file header, framed records, released sidecar.

Pure functions over bytes: no IO, no clock. Everything is little-endian. The layout follows
Quiver's WAL ("WAL File Format & Rotation", "Truncation & rotation mechanics") with the
record types a producer needs::

    file header := magic "MILLPONDWAL\\0" | version u16 | reserved u16 | file_no u64 | crc32c u32
    record      := entry_len u32 | type u8 | flags u8 | reserved u16 | seq u64 | body | crc32c u32

``entry_len`` counts the header fields after itself plus the body (not the CRC). The CRC covers
every byte of the record before it, ``entry_len`` included, so a corrupted length cannot make a
reader accept a shorter or longer record. ``seq`` numbers every record of one WAL directory,
increasing by one per record across files and restarts, so a gap in the numbers found on replay
is exactly the set of records lost. Record bodies:

    DATA := ingestion_time_ms i64 | metadata_len u32 | entry_count u32 | metadata |
            entry_len u32 * entry_count | entries    -- one produce() call; the lengths come
                                                     -- first so a call encodes with one
                                                     -- struct.pack, one join and one CRC
    BIND := first_seq u64 | last_seq u64 | record_count u32 | location_len u16 | location
                                                     -- the live DATA records in
                                                     -- [first_seq, last_seq] form the batch
                                                     -- at ``location`` (written before its PUT)
    DROP := first_seq u64 | last_seq u64             -- drop_oldest removed the live DATA
                                                     -- records in [first_seq, last_seq]

The released sidecar is a fixed 40-byte struct, replaced atomically::

    magic "MPWALREL" | version u16 | reserved u16 | released_seq u64 | file_no u64 |
    offset u64 | crc32c u32

Every record with ``seq < released_seq`` is released; replay may start at byte ``offset`` of
file ``file_no`` and skip every file numbered below it.

Unknown versions and unknown record types are refused with a :class:`FormatError`: a WAL
written by a newer millpond is never half-understood.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import crc32c as _crc32c

from millpond.errors import FormatError, InvalidInputError

__all__ = [
    "FILE_HEADER_SIZE",
    "HEAD_SIZE",
    "MAX_ENTRY_LEN",
    "RECORD_OVERHEAD",
    "SIDECAR_SIZE",
    "WAL_VERSION",
    "BindBody",
    "DataBody",
    "DropBody",
    "FileHeader",
    "RecordHead",
    "RecordType",
    "Sidecar",
    "crc32c",
    "data_record_size",
    "decode_bind",
    "decode_data",
    "decode_data_summary",
    "decode_data_views",
    "decode_drop",
    "decode_file_header",
    "decode_record_head",
    "decode_sidecar",
    "encode_bind",
    "encode_data",
    "encode_drop",
    "encode_file_header",
    "encode_sidecar",
    "plausible_head",
    "record_type_markers",
]

WAL_VERSION = 1
_FILE_MAGIC = b"MILLPONDWAL\x00"
_SIDECAR_MAGIC = b"MPWALREL"
_FILE_HEADER = struct.Struct("<12sHHQ")
_SIDECAR = struct.Struct("<8sHHQQQ")
_U32 = struct.Struct("<I")
_LEN = _U32
# type u8, flags u8, reserved u16, seq u64 -- the fixed part every record has after entry_len
_HEAD = struct.Struct("<BBHQ")
_RECORD_HEAD = struct.Struct("<IBBHQ")  # entry_len and _HEAD: HEAD_SIZE bytes
_DATA_HEAD = struct.Struct("<qII")  # ingestion_time_ms, metadata_len, entry_count
# entry_len, type, flags, reserved, seq, then the DATA head: everything before the metadata
_DATA_PREFIX = struct.Struct("<IBBHQqII")
_DATA_FIXED = _DATA_PREFIX.size - 4  # entry_len counts what follows itself
# A DATA record is joined into one buffer (one CRC call) when its payload or its average entry
# is small: a Python-level CRC call per entry then costs more than copying the entries once.
_JOIN_BELOW = 64 << 10
_JOIN_AVERAGE_BELOW = 8 << 10
_BIND_HEAD = struct.Struct("<QQIH")  # first_seq, last_seq, record_count, location_len
_DROP = struct.Struct("<QQ")

FILE_HEADER_SIZE = _FILE_HEADER.size + 4  # 28
SIDECAR_SIZE = _SIDECAR.size + 4  # 40
HEAD_SIZE = _LEN.size + _HEAD.size  # 16: entry_len plus the fixed header
RECORD_OVERHEAD = HEAD_SIZE + 4  # plus the trailing CRC
MAX_ENTRY_LEN = 0xFFFF_FFFF
_U16_MAX = 0xFFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


class RecordType(IntEnum):
    """What a WAL record holds."""

    DATA = 1
    BIND = 2
    DROP = 3


_DATA_TYPE = int(RecordType.DATA)


@dataclass(frozen=True, slots=True)
class FileHeader:
    """The fixed preamble of one WAL file."""

    file_no: int
    version: int = WAL_VERSION


class RecordHead(NamedTuple):
    """The framing of one record: its type, sequence and total size on disk."""

    type: int
    seq: int
    size: int
    """Bytes on disk, from ``entry_len`` through the CRC."""

    @property
    def body_size(self) -> int:
        return self.size - RECORD_OVERHEAD


@dataclass(frozen=True, slots=True)
class DataBody:
    """One ``produce()`` call as the WAL holds it."""

    ingestion_time_ms: int
    metadata: bytes
    entries: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BindBody:
    """Binds the live DATA records in ``[first_seq, last_seq]`` to one batch location."""

    first_seq: int
    last_seq: int
    record_count: int
    location: str


@dataclass(frozen=True, slots=True)
class DropBody:
    """The live DATA records in ``[first_seq, last_seq]`` were dropped (``drop_oldest``)."""

    first_seq: int
    last_seq: int


@dataclass(frozen=True, slots=True)
class Sidecar:
    """The released position: every record with ``seq < released_seq`` is released."""

    released_seq: int
    file_no: int
    offset: int


def encode_file_header(header: FileHeader) -> bytes:
    raw = _FILE_HEADER.pack(_FILE_MAGIC, header.version, 0, header.file_no)
    return raw + _U32.pack(crc32c(raw))


def decode_file_header(
    raw: bytes | memoryview | mmap.mmap, *, name: str = "wal file"
) -> FileHeader:
    """Validate and read a file header.

    Raises:
        FormatError: too short, wrong magic, bad CRC (``field`` says which), or an unknown
            version (``field="version"``: the file is intact but not ours to interpret).
    """
    if len(raw) < FILE_HEADER_SIZE:
        raise FormatError(
            f"{name}: header at byte 0: expected {FILE_HEADER_SIZE} bytes, found {len(raw)}",
            field="header",
            offset=0,
        )
    magic, version, reserved, file_no = _FILE_HEADER.unpack_from(raw, 0)
    (stored,) = _U32.unpack_from(raw, _FILE_HEADER.size)
    if magic != _FILE_MAGIC:
        raise FormatError(
            f"{name}: magic at byte 0: expected {_FILE_MAGIC!r}, found {bytes(magic)!r}",
            field="magic",
            offset=0,
        )
    if crc32c(memoryview(raw)[: _FILE_HEADER.size]) != stored or reserved != 0:
        raise FormatError(
            f"{name}: header crc32c at byte {_FILE_HEADER.size}: does not match the header",
            field="header_crc",
            offset=_FILE_HEADER.size,
        )
    if version != WAL_VERSION:
        raise FormatError(
            f"{name}: version at byte 12: expected {WAL_VERSION}, found {version}; this WAL "
            "was written by another millpond version",
            field="version",
            offset=12,
        )
    return FileHeader(file_no=file_no, version=version)


def _frame(record_type: RecordType, seq: int, body_parts: Sequence[bytes | memoryview]) -> bytes:
    body_len = sum(len(p) for p in body_parts)
    entry_len = _HEAD.size + body_len
    if entry_len > MAX_ENTRY_LEN:
        raise InvalidInputError(
            f"wal record: expected at most {MAX_ENTRY_LEN} bytes, found {entry_len}"
        )
    if not 0 <= seq <= _U64_MAX:
        raise InvalidInputError(f"seq: expected 0..{_U64_MAX}, found {seq}")
    head = _LEN.pack(entry_len) + _HEAD.pack(int(record_type), 0, 0, seq)
    # CRC the parts in place and join once: the entries are copied a single time.
    crc = crc32c(head)
    for part in body_parts:
        crc = crc32c(part, crc)
    return b"".join([head, *body_parts, _U32.pack(crc)])


def data_record_size(metadata_len: int, entry_lengths: Sequence[int]) -> int:
    """Bytes a DATA record with these sizes takes on disk."""
    return (
        RECORD_OVERHEAD
        + _DATA_HEAD.size
        + metadata_len
        + 4 * len(entry_lengths)
        + sum(entry_lengths)
    )


def encode_data(
    seq: int,
    ingestion_time_ms: int,
    metadata: bytes,
    entries: Sequence[bytes],
) -> list[bytes]:
    """A framed DATA record as parts to write in order (with ``writev``; join to get bytes).

    This is the WAL's hot path. Records of small entries are joined into one buffer and CRC'd
    in one call; records of large entries are returned as the caller's own entry buffers
    between a small head and the CRC, so no payload byte is copied in user space. Either way:
    one ``struct.pack`` for all lengths.

    Raises:
        InvalidInputError: the record does not fit a u32 ``entry_len``.
    """
    count = len(entries)
    if count == 1:
        payload = len(entries[0])
        lengths = _U32.pack(payload)
    else:
        sizes = list(map(len, entries))
        payload = sum(sizes)
        lengths = struct.pack(f"<{count}I", *sizes)
    entry_len = _DATA_FIXED + len(metadata) + 4 * count + payload
    if entry_len > MAX_ENTRY_LEN:
        raise InvalidInputError(
            f"wal record: expected at most {MAX_ENTRY_LEN} bytes, found {entry_len}"
        )
    prefix = _DATA_PREFIX.pack(
        entry_len, _DATA_TYPE, 0, 0, seq, ingestion_time_ms, len(metadata), count
    )
    if payload < _JOIN_BELOW or payload < _JOIN_AVERAGE_BELOW * count:
        body = b"".join([prefix, metadata, lengths, *entries])
        return [body, _U32.pack(_crc32c.crc32c(body))]
    head = prefix + metadata + lengths
    crc = _crc32c.crc32c(head)
    for entry in entries:
        crc = _crc32c.crc32c(entry, crc)
    return [head, *entries, _U32.pack(crc)]


def encode_bind(seq: int, body: BindBody) -> bytes:
    """A framed BIND record.

    Raises:
        InvalidInputError: a location over u16 bytes.
    """
    location = body.location.encode("utf-8")
    if not location or len(location) > _U16_MAX:
        raise InvalidInputError(f"location: expected 1..{_U16_MAX} bytes, found {len(location)}")
    head = _BIND_HEAD.pack(body.first_seq, body.last_seq, body.record_count, len(location))
    return _frame(RecordType.BIND, seq, [head, location])


def encode_drop(seq: int, body: DropBody) -> bytes:
    """A framed DROP record."""
    return _frame(RecordType.DROP, seq, [_DROP.pack(body.first_seq, body.last_seq)])


def decode_record_head(
    raw: bytes | memoryview | mmap.mmap, offset: int, *, name: str = "wal file"
) -> RecordHead:
    """Frame and verify the record at ``offset``; the body is not decoded.

    Raises:
        FormatError: the length runs past the end (``field="entry_len"``), the CRC does not
            match (``field="crc32c"``), or the type is unknown (``field="type"``).
    """
    end = len(raw)
    if end - offset < HEAD_SIZE + 4:
        raise FormatError(
            f"{name}: record at byte {offset}: expected at least {HEAD_SIZE + 4} bytes, "
            f"found {end - offset}",
            field="entry_len",
            offset=offset,
        )
    # The whole fixed head at once; its fields are trusted only once the CRC matched.
    entry_len, record_type, flags, reserved, seq = _RECORD_HEAD.unpack_from(raw, offset)
    size = _LEN.size + entry_len + 4
    if entry_len < _HEAD.size or offset + size > end:
        raise FormatError(
            f"{name}: entry_len at byte {offset}: {entry_len} does not fit "
            f"({end - offset} bytes left)",
            field="entry_len",
            offset=offset,
        )
    crc_at = offset + size - 4
    (stored,) = _U32.unpack_from(raw, crc_at)
    if _crc32c.crc32c(memoryview(raw)[offset:crc_at]) != stored:
        raise FormatError(
            f"{name}: crc32c at byte {crc_at}: does not match the record at byte {offset}",
            field="crc32c",
            offset=crc_at,
        )
    if record_type not in _KNOWN_TYPES or flags != 0 or reserved != 0:
        raise FormatError(
            f"{name}: type at byte {offset + 4}: expected one of "
            f"{sorted(_KNOWN_TYPES)} with zero flags, found type {record_type} flags {flags}; "
            "this WAL was written by another millpond version",
            field="type",
            offset=offset + 4,
        )
    return RecordHead(record_type, seq, size)


_KNOWN_TYPES = frozenset(int(t) for t in RecordType)


def plausible_head(raw: bytes | memoryview | mmap.mmap, offset: int, after_seq: int) -> bool:
    """A cheap pre-check used when resynchronising after corruption.

    True when the bytes at ``offset`` could start a record numbered after ``after_seq``: a
    known type, zero flags, a length that fits and a sequence within 2**32 of ``after_seq``.
    Only then is the CRC computed.
    """
    if len(raw) - offset < HEAD_SIZE + 4:
        return False
    (entry_len,) = _LEN.unpack_from(raw, offset)
    if entry_len < _HEAD.size or offset + _LEN.size + entry_len + 4 > len(raw):
        return False
    record_type, flags, reserved, seq = _HEAD.unpack_from(raw, offset + _LEN.size)
    return (
        record_type in _KNOWN_TYPES
        and flags == 0
        and reserved == 0
        and after_seq < seq <= after_seq + (1 << 32)
    )


def record_type_markers() -> tuple[bytes, ...]:
    """The four bytes (type, flags, reserved) that follow ``entry_len`` in a valid record."""
    return tuple(bytes([int(t), 0, 0, 0]) for t in RecordType)


def _body(raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead) -> memoryview:
    start = offset + HEAD_SIZE
    return memoryview(raw)[start : start + head.body_size]


def _data_layout(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, name: str
) -> tuple[int, bytes, tuple[int, ...], int]:
    """``(ingestion_time_ms, metadata, entry lengths, offset of the first entry in raw)``.

    Reads ``raw`` at absolute offsets (no view of the body): replay calls this once per record.
    """
    where = offset + HEAD_SIZE
    body_size = head.size - RECORD_OVERHEAD
    if body_size < _DATA_HEAD.size:
        raise _body_error(name, where, "DATA body too short")
    ingestion_time_ms, metadata_len, count = _DATA_HEAD.unpack_from(raw, where)
    pos = _DATA_HEAD.size
    if pos + metadata_len + 4 * count > body_size:
        raise _body_error(
            name, where + 8, f"metadata_len {metadata_len} and entry_count {count} do not fit"
        )
    metadata = bytes(raw[where + pos : where + pos + metadata_len])
    pos += metadata_len
    lengths = struct.unpack_from(f"<{count}I", raw, where + pos)
    pos += 4 * count
    if pos + sum(lengths) != body_size:
        raise _body_error(
            name, where + pos, f"entry lengths sum to {sum(lengths)}, {body_size - pos} bytes left"
        )
    return ingestion_time_ms, metadata, lengths, where + pos


def decode_data(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, *, name: str = "wal file"
) -> DataBody:
    """Decode the body of a verified DATA record.

    Raises:
        FormatError: the body's own lengths are inconsistent.
    """
    ingestion_time_ms, metadata, lengths, pos = _data_layout(raw, offset, head, name)
    view = memoryview(raw)
    entries = []
    for size in lengths:
        entries.append(bytes(view[pos : pos + size]))
        pos += size
    return DataBody(ingestion_time_ms, metadata, tuple(entries))


def decode_data_views(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, *, name: str = "wal file"
) -> list[memoryview]:
    """The entries of a verified DATA record as views into ``raw`` (no copies).

    Raises:
        FormatError: the body's own lengths are inconsistent.
    """
    _, _, lengths, pos = _data_layout(raw, offset, head, name)
    view = memoryview(raw)
    views = []
    for size in lengths:
        views.append(view[pos : pos + size])
        pos += size
    return views


def decode_data_summary(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, *, name: str = "wal file"
) -> tuple[int, bytes, int, int]:
    """``(ingestion_time_ms, metadata, entry_count, entry_bytes)`` without copying entries.

    Raises:
        FormatError: the body's own lengths are inconsistent.
    """
    ingestion_time_ms, metadata, lengths, _ = _data_layout(raw, offset, head, name)
    return ingestion_time_ms, metadata, len(lengths), sum(lengths)


def decode_bind(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, *, name: str = "wal file"
) -> BindBody:
    """Decode the body of a verified BIND record.

    Raises:
        FormatError: the body's own lengths are inconsistent.
    """
    body = _body(raw, offset, head)
    where = offset + HEAD_SIZE
    if len(body) < _BIND_HEAD.size:
        raise _body_error(name, where, "BIND body too short")
    first, last, count, location_len = _BIND_HEAD.unpack_from(body, 0)
    if _BIND_HEAD.size + location_len != len(body):
        raise _body_error(name, where, f"location_len {location_len} does not match the body")
    try:
        location = str(body[_BIND_HEAD.size :], "utf-8")
    except UnicodeDecodeError as err:
        raise _body_error(name, where + _BIND_HEAD.size, "location is not UTF-8") from err
    return BindBody(first_seq=first, last_seq=last, record_count=count, location=location)


def decode_drop(
    raw: bytes | memoryview | mmap.mmap, offset: int, head: RecordHead, *, name: str = "wal file"
) -> DropBody:
    """Decode the body of a verified DROP record.

    Raises:
        FormatError: the body has the wrong size.
    """
    body = _body(raw, offset, head)
    if len(body) != _DROP.size:
        raise _body_error(name, offset + HEAD_SIZE, f"DROP body of {len(body)} bytes")
    first, last = _DROP.unpack_from(body, 0)
    return DropBody(first_seq=first, last_seq=last)


def encode_sidecar(sidecar: Sidecar) -> bytes:
    raw = _SIDECAR.pack(
        _SIDECAR_MAGIC, WAL_VERSION, 0, sidecar.released_seq, sidecar.file_no, sidecar.offset
    )
    return raw + _U32.pack(crc32c(raw))


def decode_sidecar(raw: bytes | memoryview | mmap.mmap, *, name: str = "released") -> Sidecar:
    """Validate and read the released sidecar.

    Raises:
        FormatError: wrong size, magic, CRC or version.
    """
    if len(raw) != SIDECAR_SIZE:
        raise FormatError(
            f"{name}: expected {SIDECAR_SIZE} bytes, found {len(raw)}", field="size", offset=0
        )
    magic, version, reserved, released_seq, file_no, offset = _SIDECAR.unpack_from(raw, 0)
    (stored,) = _U32.unpack_from(raw, _SIDECAR.size)
    if magic != _SIDECAR_MAGIC:
        raise FormatError(
            f"{name}: magic at byte 0: expected {_SIDECAR_MAGIC!r}, found {bytes(magic)!r}",
            field="magic",
            offset=0,
        )
    if crc32c(memoryview(raw)[: _SIDECAR.size]) != stored or reserved != 0:
        raise FormatError(
            f"{name}: crc32c at byte {_SIDECAR.size}: does not match",
            field="crc32c",
            offset=_SIDECAR.size,
        )
    if version != WAL_VERSION:
        raise FormatError(
            f"{name}: version at byte 8: expected {WAL_VERSION}, found {version}",
            field="version",
            offset=8,
        )
    return Sidecar(released_seq=released_seq, file_no=file_no, offset=offset)


def _body_error(name: str, offset: int, what: str) -> FormatError:
    return FormatError(f"{name}: record body at byte {offset}: {what}", field="body", offset=offset)
