"""Recovering a WAL directory on open: what it holds, what is released, what was lost.

:func:`scan_directory` reads the released sidecar (a damaged one means "scan everything"),
deletes files the sidecar says are wholly released, scans every other file with
:func:`millpond.wal.scan.scan_file`, cuts a torn tail of the newest file back to its last whole
record, and collects mid-file corruption. :class:`~millpond.wal.Wal` then copies what damaged
files still hold into a fresh file and moves them into ``quarantine/`` (:func:`quarantine`).

Also here: the types replay hands out (:class:`WalRef`, :class:`WalRecord`), the report
(:class:`RecoveryReport`, :class:`LostRegion`), and the file naming the WAL shares.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from millpond.errors import FormatError
from millpond.formats.wal import (
    FILE_HEADER_SIZE,
    BindBody,
    DropBody,
    RecordType,
    Sidecar,
    decode_sidecar,
)
from millpond.storage.file_store import fsync_dir
from millpond.wal.scan import LostRegion, ScannedRecord, scan_file

__all__ = [
    "QUARANTINE_DIR",
    "SIDECAR_NAME",
    "FileIndex",
    "LostRegion",
    "RecoveryReport",
    "ScanOutcome",
    "WalRecord",
    "WalRef",
    "file_name",
    "quarantine",
    "scan_directory",
]

logger = logging.getLogger(__name__)

SIDECAR_NAME = "released"
QUARANTINE_DIR = "quarantine"
_SUFFIX = ".wal"
_NAME_DIGITS = 20


class WalRef(NamedTuple):
    """Where one record lives: file number, byte offset and size on disk.

    A named tuple rather than a frozen dataclass: one is made per ``produce()`` call on the
    staging hot path, and a tuple is several times cheaper to build.
    """

    file_no: int
    offset: int
    size: int


class WalRecord(NamedTuple):
    """A record found on replay (DATA entries stay on disk; read them with ``Wal.read_data``)."""

    seq: int
    type: RecordType
    ref: WalRef
    ingestion_time_ms: int = 0
    metadata: bytes = b""
    entry_count: int = 0
    entry_bytes: int = 0
    bind: BindBody | None = None
    drop: DropBody | None = None


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`~millpond.wal.Wal.open` found: what it replayed and everything it could not."""

    directory: str
    released_seq: int
    """Records below this sequence were released before the restart."""
    files_scanned: int = 0
    records_replayed: int = 0
    """Unreleased records handed back to the caller."""
    torn_tail_bytes: int = 0
    """Bytes cut from the end of the newest file (a write a crash interrupted)."""
    torn_tail_file: str | None = None
    lost_regions: tuple[LostRegion, ...] = ()
    """Mid-file corruption: bytes that held no verifiable record."""
    quarantined: tuple[str, ...] = ()
    """Damaged files moved into ``quarantine/`` (their good records were kept)."""
    sidecar_problem: str | None = None
    """Why the released sidecar was not trusted (everything was scanned instead)."""

    @property
    def clean(self) -> bool:
        """Nothing was lost or quarantined (a torn tail alone is normal after a crash)."""
        return not self.lost_regions and not self.quarantined and self.sidecar_problem is None

    @property
    def lost_bytes(self) -> int:
        return sum(region.end - region.start for region in self.lost_regions)

    @property
    def lost_seqs(self) -> tuple[range, ...]:
        """Sequence numbers of records known to be destroyed (released ones excluded)."""
        found: list[range] = []
        for region in self.lost_regions:
            seqs = region.lost_seqs
            if seqs is not None:
                start = max(seqs.start, self.released_seq)
                if start < seqs.stop:
                    found.append(range(start, seqs.stop))
        return tuple(found)

    def summary(self) -> str:
        """One line for a log."""
        parts = [f"replayed {self.records_replayed} records from {self.files_scanned} files"]
        if self.torn_tail_bytes:
            parts.append(f"cut a torn tail of {self.torn_tail_bytes} bytes")
        if self.lost_regions:
            seqs = ", ".join(f"{r.start}..{r.stop - 1}" for r in self.lost_seqs) or "unknown"
            parts.append(
                f"LOST {self.lost_bytes} corrupt bytes in {len(self.lost_regions)} regions "
                f"(record seqs {seqs})"
            )
        if self.quarantined:
            parts.append(f"quarantined {', '.join(self.quarantined)}")
        if self.sidecar_problem:
            parts.append(f"ignored the released sidecar ({self.sidecar_problem})")
        return f"WAL {self.directory}: " + "; ".join(parts)


@dataclass(slots=True)
class FileIndex:
    """A WAL file we know about: its size and the (ascending) sequences it holds."""

    file_no: int
    path: Path
    size: int
    seqs: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    @property
    def max_seq(self) -> int:
        return self.seqs[-1] if self.seqs else -1


@dataclass(slots=True)
class ScanOutcome:
    """What :func:`scan_directory` found, for :class:`~millpond.wal.Wal` to act on."""

    released: int
    """Every record below this sequence is released (0 without a trusted sidecar)."""
    files: list[FileIndex]
    """Undamaged files, oldest first, indexed by the unreleased records they hold."""
    found: dict[int, tuple[WalRecord, bytes | None]]
    """Unreleased records by sequence. Records of damaged files keep their bytes: they must
    be copied out before their file is quarantined."""
    corrupt: list[Path]
    lost: list[LostRegion]
    files_scanned: int
    last_file_no: int
    torn_bytes: int = 0
    torn_file: str | None = None
    sidecar_problem: str | None = None


def scan_directory(directory: Path) -> ScanOutcome:
    """Scan a WAL directory the caller has locked.

    Deletes files the sidecar marks released and cuts a torn tail off the newest file; every
    other change (salvage, quarantine) is left to the caller.

    Raises:
        FormatError: a WAL written by another millpond version.
        OSError: the directory cannot be read or written.
    """
    with contextlib.suppress(FileNotFoundError):
        (directory / f"{SIDECAR_NAME}.tmp").unlink()
    sidecar, sidecar_problem = _read_sidecar(directory / SIDECAR_NAME)
    released = sidecar.released_seq if sidecar else 0
    numbers = _file_numbers(directory)
    if sidecar is not None:
        # Files below the sidecar's file hold only released records; a crash after the
        # sidecar was written but before they were deleted leaves them behind.
        for file_no in [n for n in numbers if n < sidecar.file_no]:
            (directory / file_name(file_no)).unlink()
            numbers.remove(file_no)
        fsync_dir(directory)
    outcome = ScanOutcome(
        released=released,
        files=[],
        found={},
        corrupt=[],
        lost=[],
        files_scanned=len(numbers),
        last_file_no=max(numbers, default=0),
        sidecar_problem=sidecar_problem,
    )
    for file_no in numbers:
        start = sidecar.offset if sidecar and file_no == sidecar.file_no else FILE_HEADER_SIZE
        _scan_one(directory, file_no, start, file_no == numbers[-1], outcome)
    _fill_unknown_neighbours(outcome.lost, [r for r, _ in outcome.found.values()], released)
    return outcome


def _scan_one(
    directory: Path, file_no: int, start: int, newest: bool, outcome: ScanOutcome
) -> None:
    path = directory / file_name(file_no)
    # Map the file rather than read it: replay touches every byte once, and filling a fresh
    # buffer the size of the file cost more than the scan itself (bench_wal_replay).
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            cut_to = _scan_mapped(path, file_no, b"", start, newest, outcome)
        else:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                cut_to = _scan_mapped(path, file_no, mapped, start, newest, outcome)
    # Cut the torn tail only once the map is gone: touching a mapped page past a new end of
    # file would raise SIGBUS.
    if cut_to is not None:
        _truncate(path, cut_to)
        if cut_to == 0:
            path.unlink()
            fsync_dir(directory)


def _scan_mapped(
    path: Path,
    file_no: int,
    raw: bytes | mmap.mmap,
    start: int,
    newest: bool,
    outcome: ScanOutcome,
) -> int | None:
    """Index one file's records into ``outcome``; returns where to cut a torn tail, if any."""
    released, found = outcome.released, outcome.found
    scan = scan_file(
        raw,
        name=path.name,
        start=start if start <= len(raw) else FILE_HEADER_SIZE,
        after_seq=released - 1,
        newest=newest,
        file_no=file_no,
    )
    cut_to: int | None = None
    if scan.torn_tail:
        outcome.torn_bytes, outcome.torn_file = scan.torn_tail, path.name
        cut_to = scan.good_end
        if cut_to == 0:
            return cut_to
    damaged = scan.corrupt
    if damaged:
        outcome.corrupt.append(path)
        outcome.lost.extend(scan.bad_regions)
        if scan.header_problem and not scan.bad_regions:
            logger.warning("WAL %s: %s", path, scan.header_problem)
    index = FileIndex(file_no, path, scan.good_end if scan.torn_tail else len(raw))
    for record in scan.records:
        if record.seq < released:
            continue
        earlier = found.get(record.seq)
        # The same record twice: a salvage copy whose damaged original was not yet
        # quarantined when the process died. Keep one, preferring an undamaged file.
        if earlier is not None and (damaged or earlier[1] is None):
            continue
        ref = WalRef(file_no, record.offset, record.size)
        keep = raw[record.offset : record.offset + record.size] if damaged else None
        found[record.seq] = (_to_wal_record(record, ref), keep)
        if not damaged:
            index.seqs.append(record.seq)
            index.offsets.append(record.offset)
    if not damaged:
        # Sequences ascend within a file; sort in case salvage wrote older ones first.
        order = sorted(range(len(index.seqs)), key=index.seqs.__getitem__)
        index.seqs = [index.seqs[i] for i in order]
        index.offsets = [index.offsets[i] for i in order]
        outcome.files.append(index)
    return cut_to


def file_name(file_no: int) -> str:
    return f"{file_no:0{_NAME_DIGITS}d}{_SUFFIX}"


def _file_numbers(directory: Path) -> list[int]:
    numbers = []
    for entry in directory.iterdir():
        stem = entry.name[: -len(_SUFFIX)]
        # isascii(): isdigit() also takes digits such as "²", which int() refuses.
        if entry.name.endswith(_SUFFIX) and stem.isascii() and stem.isdigit() and entry.is_file():
            numbers.append(int(stem))
    return sorted(numbers)


def _read_sidecar(path: Path) -> tuple[Sidecar | None, str | None]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        return decode_sidecar(raw, name=path.name), None
    except FormatError as err:
        if err.field == "version":
            raise
        logger.warning("WAL sidecar %s is damaged (%s); scanning every file", path, err)
        return None, str(err)


def _to_wal_record(record: ScannedRecord, ref: WalRef) -> WalRecord:
    if record.data is not None:
        # DataSummary's fields are WalRecord's from ingestion_time_ms on, in the same order.
        return WalRecord(record.seq, record.type, ref, *record.data)
    return WalRecord(record.seq, record.type, ref, bind=record.bind, drop=record.drop)


def _fill_unknown_neighbours(
    lost: list[LostRegion], records: list[WalRecord], released: int
) -> None:
    """Bound regions at a file's edge by the nearest good records in other files.

    Nothing below ``released`` matters, so ``released - 1`` bounds a region from below when no
    good record precedes it.
    """
    seqs = sorted(r.seq for r in records)
    for i, region in enumerate(lost):
        after, before = region.after_seq, region.before_seq
        if before is None and after is not None:
            j = bisect.bisect_right(seqs, after)
            before = seqs[j] if j < len(seqs) else None
        if after is None and before is not None:
            j = bisect.bisect_left(seqs, before)
            after = seqs[j - 1] if j > 0 else released - 1
        lost[i] = LostRegion(region.file, region.start, region.end, after, before)


def _truncate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def quarantine(path: Path) -> str:
    target_dir = path.parent / QUARANTINE_DIR
    target_dir.mkdir(exist_ok=True)
    target = target_dir / f"{path.name}.{time.time_ns()}"
    os.replace(path, target)
    fsync_dir(target_dir)
    fsync_dir(path.parent)
    logger.warning("WAL file %s had mid-file corruption; moved to %s", path, target)
    return str(target)
