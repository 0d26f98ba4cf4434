"""Scanning one WAL file's bytes on replay: whole records, torn tails, corrupt regions.

Pure: bytes in, a :class:`FileScan` out. Every record is CRC-checked before anything in it is
believed. A record that fails its check starts a *bad region*; the scanner then looks for the
next offset where a record with a plausible header and a matching CRC starts, so one flipped
byte costs the records it hit, not the rest of the file. A bad region that runs to the end of
the newest file is a torn tail (a write cut short by a crash) and is cut off; anywhere else it
is corruption, and the file is quarantined by the caller.

A file's header is fdatasynced before any record is written to it, so a power loss while a new
file was being created leaves a file that never held a record: shorter than the header, or with
parts of the header that never reached the disk read back as zeros (a file system that kept the
new size but not the block), and nothing but zeros after it. In the newest file that whole file
is a torn tail, like a record cut short. A header that differs from the one written by anything
but zeros, or a damaged header followed by anything that is not zero, is corruption.

Sequence numbers increase by one per record, so the records a bad region destroyed are exactly
the numbers missing between the good records around it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import NamedTuple

from millpond.errors import FormatError
from millpond.formats.wal import (
    FILE_HEADER_SIZE,
    BindBody,
    DropBody,
    FileHeader,
    RecordType,
    decode_bind,
    decode_data_summary,
    decode_drop,
    decode_file_header,
    decode_record_head,
    encode_file_header,
    plausible_head,
    record_type_markers,
)

__all__ = ["DataSummary", "FileScan", "LostRegion", "ScannedRecord", "scan_file"]

_MARKERS = record_type_markers()
_TYPES = {int(t): t for t in RecordType}  # a dict lookup is cheaper than RecordType(n)
# The header's bytes that do not depend on the file's number: magic, version, reserved.
_HEADER_FIXED = encode_file_header(FileHeader(file_no=0))[:16]
_ZERO_CHUNK = 1 << 20


class DataSummary(NamedTuple):
    """What replay needs of a DATA record without holding its entries in memory.

    This, :class:`ScannedRecord`, ``RecordHead`` and ``WalRecord`` are named tuples rather
    than frozen dataclasses: replay makes one of each per record, and a frozen dataclass costs
    several times as much to build (bench_wal_replay).
    """

    ingestion_time_ms: int
    metadata: bytes
    entry_count: int
    entry_bytes: int


class ScannedRecord(NamedTuple):
    """One verified record: where it is and what it says (entries stay on disk)."""

    seq: int
    type: RecordType
    offset: int
    size: int
    data: DataSummary | None = None
    bind: BindBody | None = None
    drop: DropBody | None = None


@dataclass(frozen=True, slots=True)
class LostRegion:
    """Bytes of one file that held no verifiable record."""

    file: str
    start: int
    end: int
    after_seq: int | None
    """The last good record before the damage, if known (a scan of one file: in that file)."""
    before_seq: int | None
    """The first good record after it, if known (a scan of one file: in that file)."""

    @property
    def lost_seqs(self) -> range | None:
        """The record sequence numbers destroyed, when both neighbours are known."""
        if self.after_seq is None or self.before_seq is None:
            return None
        return range(self.after_seq + 1, self.before_seq)


@dataclass(slots=True)
class FileScan:
    """The result of scanning one file."""

    file_no: int | None
    """From the header; None when the header is unreadable."""
    records: list[ScannedRecord] = field(default_factory=list)
    bad_regions: list[LostRegion] = field(default_factory=list)
    good_end: int = FILE_HEADER_SIZE
    """End of the last good record: where a torn tail is cut."""
    torn_tail: int = 0
    """Bytes after ``good_end`` that form a torn tail (newest file only)."""
    header_problem: str | None = None

    @property
    def corrupt(self) -> bool:
        """Mid-file damage: the caller must quarantine this file."""
        return bool(self.bad_regions) or self.header_problem is not None


def scan_file(
    raw: bytes | mmap.mmap,
    *,
    name: str,
    start: int = FILE_HEADER_SIZE,
    after_seq: int = -1,
    newest: bool,
    file_no: int | None = None,
) -> FileScan:
    """Scan ``raw`` (a whole WAL file) from ``start``.

    Args:
        raw: the file's bytes.
        name: the file name, for messages.
        start: the first record offset to read (the released sidecar may skip ahead).
        after_seq: every record of interest has a higher sequence (used to resynchronise).
        newest: whether this is the newest file, the only one that can have a torn tail.
        file_no: the number the file's name gives it, so a torn header can be compared with
            the one it was created with (without it, only the bytes every header shares are).

    Returns:
        The verified records, bad regions, and the torn-tail length.

    Raises:
        FormatError: an intact file or record of an unknown version or type: the WAL was
            written by another millpond version and must not be guessed at.
    """
    scan = FileScan(file_no=None)
    try:
        scan.file_no = decode_file_header(raw, name=name).file_no
    except FormatError as err:
        if err.field == "version":
            raise
        if newest and _torn_header(raw, file_no):
            # Created but never completed: a crash while its header was being written (it is
            # synced before any record is). Nothing in it was staged.
            scan.torn_tail = len(raw)
            scan.good_end = 0
            return scan
        scan.header_problem = str(err)
    _scan_records(
        raw, scan, name=name, start=max(start, FILE_HEADER_SIZE), after_seq=after_seq, newest=newest
    )
    return scan


def _scan_records(
    raw: bytes | mmap.mmap,
    scan: FileScan,
    *,
    name: str,
    start: int,
    after_seq: int,
    newest: bool,
) -> None:
    """Read the records from ``start`` to the end into ``scan``, with the bad regions between
    them and the torn tail (arguments: :func:`scan_file`'s).

    Raises:
        FormatError: a record of an unknown version or type.
    """
    pos = start
    scan.good_end = pos
    last_seq = after_seq
    last_good: int | None = None
    end = len(raw)
    while pos < end:
        record = _read_record(raw, pos, name)
        if record is not None:
            scan.records.append(record)
            last_seq = max(last_seq, record.seq)
            last_good = record.seq
            pos += record.size
            scan.good_end = pos
            continue
        resume = _resync(raw, pos + 1, last_seq, name)
        if resume is None:
            if newest and scan.header_problem is None:
                scan.torn_tail = end - pos
            else:
                scan.bad_regions.append(LostRegion(name, pos, end, last_good, None))
            break
        next_record = _read_record(raw, resume, name)
        assert next_record is not None  # _resync verified it
        scan.bad_regions.append(LostRegion(name, pos, resume, last_good, next_record.seq))
        pos = resume


def _torn_header(raw: bytes | mmap.mmap, file_no: int | None) -> bool:
    """Whether an unreadable header is what a power loss leaves of a file being created:
    shorter than a header, or every byte of it as written or zero, and only zeros after it."""
    if len(raw) < FILE_HEADER_SIZE:
        return True
    if file_no is not None:
        written = encode_file_header(FileHeader(file_no=file_no))
    else:
        written = _HEADER_FIXED
    found = raw[: len(written)]
    if any(byte not in (0, expected) for byte, expected in zip(found, written, strict=True)):
        return False
    return all(
        not raw[pos : pos + _ZERO_CHUNK].strip(b"\0")
        for pos in range(FILE_HEADER_SIZE, len(raw), _ZERO_CHUNK)
    )


def _read_record(raw: bytes | mmap.mmap, pos: int, name: str) -> ScannedRecord | None:
    """The verified record at ``pos``, or None when there is none."""
    try:
        head = decode_record_head(raw, pos, name=name)
    except FormatError as err:
        if err.field == "type":
            raise
        return None
    record_type = _TYPES[head.type]
    try:
        if record_type is RecordType.DATA:
            summary = DataSummary(*decode_data_summary(raw, pos, head, name=name))
            return ScannedRecord(head.seq, record_type, pos, head.size, data=summary)
        if record_type is RecordType.BIND:
            bind = decode_bind(raw, pos, head, name=name)
            return ScannedRecord(head.seq, record_type, pos, head.size, bind=bind)
        drop = decode_drop(raw, pos, head, name=name)
        return ScannedRecord(head.seq, record_type, pos, head.size, drop=drop)
    except FormatError:
        # A CRC-valid record with an inconsistent body: never trust it.
        return None


def _resync(raw: bytes | mmap.mmap, start: int, after_seq: int, name: str) -> int | None:
    """The first offset at or after ``start`` where a verifiable record begins."""
    pos = start
    while True:
        hits = [i for marker in _MARKERS if (i := raw.find(marker, pos + 4)) != -1]
        if not hits:
            return None
        candidate = min(hits) - 4
        if plausible_head(raw, candidate, after_seq) and _read_record(raw, candidate, name):
            return candidate
        pos = candidate + 1
