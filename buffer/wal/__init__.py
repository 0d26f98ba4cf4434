"""The local write-ahead log: numbered files in one directory, owned by one process at a time.

Layout of a WAL directory::

    LOCK                      exclusive flock, held for the life of the Wal (holds the pid)
    00000000000000000001.wal  numbered files; only the highest is appended to
    released                  the released sidecar (see ``wal_format``)
    quarantine/               files with mid-file corruption, moved aside on recovery

Durability rules, following Quiver's WAL design and doing better where it is loose:

* A record is durable once :meth:`Wal.sync` returned after it was appended (``fdatasync``;
  callers group many appends under one sync).
* Files are created with ``O_EXCL``, their header fsynced, and the directory fsynced; every
  rename and delete is followed by an fsync of the directory, or it can be lost on power
  failure.
* Rotation fsyncs the old file completely before the next one is used, so only the newest
  file can ever end in a torn record.
* What a sync made durable leaves the page cache (``posix_fadvise`` DONTNEED): the WAL is read
  back only after a crash or when a batch outgrew the producer's memory budget, and keeping it
  cached takes memory (and, on a VM, fresh pages that are slow to get) from everything else.
* :meth:`Wal.release` writes the sidecar to a temp file, fsyncs it, renames it over the old one
  and fsyncs the directory, and only then deletes whole files that hold nothing unreleased.

Recovery (:meth:`Wal.open`, with :func:`millpond.wal.recovery.scan_directory`): take the lock,
read the sidecar (a damaged one means "scan everything"), scan each remaining file, cut a torn tail
of the newest file back to its last whole record, copy the still-needed records of any file with
mid-file corruption into the new file (same sequence numbers, fsynced) and move the damaged file
into ``quarantine/``. What was lost is listed in the :class:`RecoveryReport`; the caller decides
how loudly to say so.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from millpond.common.metrics import LatencySummary
from millpond.errors import ConfigError, FormatError, StorageError
from millpond.formats.wal import (
    BindBody,
    DataBody,
    DropBody,
    FileHeader,
    RecordHead,
    RecordType,
    Sidecar,
    decode_data,
    decode_data_views,
    decode_record_head,
    encode_bind,
    encode_data,
    encode_drop,
    encode_file_header,
    encode_sidecar,
)
from millpond.storage.file_store import fsync_dir, write_all
from millpond.wal.recovery import (
    SIDECAR_NAME,
    FileIndex,
    LostRegion,
    RecoveryReport,
    WalRecord,
    WalRef,
    file_name,
    quarantine,
    scan_directory,
)

__all__ = ["SIDECAR_NAME", "LostRegion", "RecoveryReport", "Wal", "WalRecord", "WalRef"]

logger = logging.getLogger(__name__)

LOCK_NAME = "LOCK"


class Wal:
    """An open WAL directory. Thread-safe; use :meth:`open`."""

    def __init__(
        self,
        directory: Path,
        lock_fd: int,
        *,
        rotate_bytes: int,
        fsync_latency: LatencySummary | None,
    ) -> None:
        self.directory = directory
        self._lock_fd = lock_fd
        self._rotate_bytes = rotate_bytes
        self.fsync_latency = fsync_latency or LatencySummary()
        self._lock = threading.Lock()
        self._release_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._retired: list[int] = []
        self._files: list[FileIndex] = []
        self._fd = -1
        self._next_seq = 0
        self._released_seq = 0
        self._written = 0  # bytes appended since open (all files)
        self._synced = 0
        self._closed = False
        self.records: list[WalRecord] = []
        self.report = RecoveryReport(directory=str(directory), released_seq=0)

    # -- opening and recovery -------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        rotate_bytes: int = 64 << 20,
        fsync_latency: LatencySummary | None = None,
    ) -> Wal:
        """Lock ``directory``, recover what it holds and open a fresh file for appends.

        The unreleased records are in :attr:`records` (sorted by sequence) and what recovery
        found is in :attr:`report`.

        Raises:
            ConfigError: another process (or Wal in this process) holds the directory.
            FormatError: the WAL was written by another millpond version.
            StorageError: the directory cannot be read or written.
        """
        path = Path(directory).resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock_directory(path)
        except OSError as err:
            raise StorageError(f"WAL {path}: cannot open: {err}") from err
        wal = cls(path, lock_fd, rotate_bytes=rotate_bytes, fsync_latency=fsync_latency)
        try:
            wal._recover()
        except BaseException:
            os.close(lock_fd)
            raise
        return wal

    def _recover(self) -> None:
        try:
            self._recover_files()
        except OSError as err:
            raise StorageError(f"WAL {self.directory}: recovery failed: {err}") from err

    def _recover_files(self) -> None:
        outcome = scan_directory(self.directory)
        self._files = outcome.files
        self._next_seq = max([outcome.released, *(seq + 1 for seq in outcome.found)])
        self._released_seq = outcome.released
        self._start_file(outcome.last_file_no + 1)
        found = outcome.found
        # Salvage: copy what a damaged file still holds into the new file, then move the
        # damaged file aside. Same sequence numbers, so BIND and DROP records still apply.
        salvage = sorted((seq, raw) for seq, (_, raw) in found.items() if raw is not None)
        if salvage:
            placed = self._append_raw([(raw,) for _, raw in salvage], [s for s, _ in salvage])
            self._sync_locked()
            for (seq, _), ref in zip(salvage, placed, strict=True):
                found[seq] = (found[seq][0]._replace(ref=ref), None)
        quarantined = [quarantine(path) for path in outcome.corrupt]
        # Files holding only released records (a crash before their deletion) go now, so
        # they do not count against wal_max_bytes until the next release.
        idle = [f for f in self._files[:-1] if not f.seqs]
        if idle:
            for dead in idle:
                dead.path.unlink()
            fsync_dir(self.directory)
            self._files = [f for f in self._files if f not in idle]
        self.records = [found[seq][0] for seq in sorted(found)]
        self.report = RecoveryReport(
            directory=str(self.directory),
            released_seq=outcome.released,
            files_scanned=outcome.files_scanned,
            records_replayed=len(self.records),
            torn_tail_bytes=outcome.torn_bytes,
            torn_tail_file=outcome.torn_file,
            lost_regions=tuple(outcome.lost),
            quarantined=tuple(quarantined),
            sidecar_problem=outcome.sidecar_problem,
        )

    # -- appending ------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence the next record will get."""
        with self._lock:
            return self._next_seq

    @property
    def bytes_used(self) -> int:
        """Bytes of every WAL file on disk (what ``wal_max_bytes`` caps)."""
        with self._lock:
            return sum(f.size for f in self._files)

    @property
    def file_count(self) -> int:
        with self._lock:
            return len(self._files)

    def append_data(
        self, items: Sequence[tuple[int, bytes, Sequence[bytes]]]
    ) -> list[tuple[int, WalRef]]:
        """Append one DATA record per ``(ingestion_time_ms, metadata, entries)``, in one write.

        Not durable until :meth:`sync` returns.

        Returns:
            Each record's sequence and location.

        Raises:
            StorageError: the write failed (the WAL is then closed to appends).
        """
        with self._lock:
            self._check_open()
            first = self._next_seq
            encoded = [
                encode_data(first + i, when, metadata, entries)
                for i, (when, metadata, entries) in enumerate(items)
            ]
            refs = self._append_raw(encoded, list(range(first, first + len(encoded))))
            return [(first + i, ref) for i, ref in enumerate(refs)]

    def append_bind(self, body: BindBody) -> int:
        """Append a BIND record; returns its sequence. Not durable until :meth:`sync`.

        Raises:
            StorageError: the write failed.
        """
        return self._append_one(lambda seq: encode_bind(seq, body))

    def append_drop(self, body: DropBody) -> int:
        """Append a DROP record; returns its sequence. Not durable until :meth:`sync`.

        Raises:
            StorageError: the write failed.
        """
        return self._append_one(lambda seq: encode_drop(seq, body))

    def _append_one(self, encode: Callable[[int], bytes]) -> int:
        with self._lock:
            self._check_open()
            seq = self._next_seq
            self._append_raw([(encode(seq),)], [seq])
            return seq

    def sync(self) -> None:
        """Make every record appended so far durable (one ``fdatasync`` for all of them).

        Appends, reads of ``bytes_used`` and releases go on while the disk syncs: only
        concurrent syncs queue behind each other (and find their bytes already durable).

        Raises:
            StorageError: the sync failed.
        """
        with self._sync_lock:
            with self._lock:
                self._check_open()
                self._close_retired()
                target, fd, end = self._written, self._fd, self._files[-1].size
                if self._synced >= target:
                    return
            started = time.monotonic()
            try:
                _fdatasync(fd)
            except OSError as err:
                with self._lock:
                    self._closed = True
                raise StorageError(f"WAL {self.directory}: fdatasync failed: {err}") from err
            self.fsync_latency.observe(time.monotonic() - started)
            _drop_cached(fd, end)
            with self._lock:
                self._synced = max(self._synced, target)

    def _close_retired(self) -> None:
        # Descriptors of rotated files are closed only here, under the sync lock, so a sync
        # in progress never sees its descriptor closed (or reused by another file).
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()

    def _sync_locked(self) -> None:
        if self._synced >= self._written:
            return
        started = time.monotonic()
        try:
            _fdatasync(self._fd)
        except OSError as err:
            self._closed = True
            raise StorageError(f"WAL {self.directory}: fdatasync failed: {err}") from err
        self.fsync_latency.observe(time.monotonic() - started)
        self._synced = self._written
        _drop_cached(self._fd, self._files[-1].size)

    def _append_raw(self, records: Sequence[Sequence[bytes]], seqs: Sequence[int]) -> list[WalRef]:
        """Write records (each a tuple of parts) at the end of the active file, in one go."""
        sizes = [sum(map(len, parts)) for parts in records]
        total = sum(sizes)
        active = self._files[-1]
        if active.seqs and active.size + total > self._rotate_bytes:
            self._rotate()
            active = self._files[-1]
        refs: list[WalRef] = []
        offset = active.size
        for size, seq in zip(sizes, seqs, strict=True):
            refs.append(WalRef(active.file_no, offset, size))
            active.seqs.append(seq)
            active.offsets.append(offset)
            offset += size
        try:
            _write_parts(self._fd, [part for parts in records for part in parts], total)
        except OSError as err:
            # Cut the partial record off, or later records would sit behind garbage.
            self._closed = True
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, active.size)
            del active.seqs[-len(records) :], active.offsets[-len(records) :]
            raise StorageError(f"WAL {active.path}: write failed: {err}") from err
        active.size = offset
        self._written += total
        self._next_seq = max(self._next_seq, max(seqs) + 1)
        return refs

    def _rotate(self) -> None:
        # Everything in the old file must be durable before the next file is used: only the
        # newest file may end in a torn record.
        self._sync_locked()
        self._start_file(self._files[-1].file_no + 1)

    def _start_file(self, file_no: int) -> None:
        path = self.directory / file_name(file_no)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        header = encode_file_header(FileHeader(file_no=file_no))
        try:
            write_all(fd, header)
            _fdatasync(fd)
        except OSError:
            os.close(fd)
            raise
        fsync_dir(self.directory)
        if self._fd >= 0:
            self._retired.append(self._fd)
        self._fd = fd
        self._files.append(FileIndex(file_no, path, len(header)))

    # -- releasing ------------------------------------------------------------------------

    @property
    def released_seq(self) -> int:
        with self._lock:
            return self._released_seq

    def release(self, released_seq: int) -> int:
        """Mark every record below ``released_seq`` released; delete files left with none.

        The sidecar is replaced atomically before any file is deleted. A fully released newest
        file holding at least half of ``rotate_bytes`` is rotated first so it can go too.

        Returns:
            How many files were deleted.

        Raises:
            StorageError: the sidecar could not be written.
        """
        with self._release_lock:
            with self._lock:
                self._check_open()
                if released_seq <= self._released_seq:
                    return 0
                released_seq = min(released_seq, self._next_seq)
                active = self._files[-1]
                if active.max_seq < released_seq and active.size >= self._rotate_bytes // 2:
                    self._rotate()
                doomed = [f for f in self._files[:-1] if f.max_seq < released_seq]
                keep = [f for f in self._files if f not in doomed]
                first = keep[0]
                index = bisect.bisect_left(first.seqs, released_seq)
                offset = first.offsets[index] if index < len(first.seqs) else first.size
                sidecar = Sidecar(released_seq, first.file_no, offset)
            try:
                _replace_file(self.directory, SIDECAR_NAME, encode_sidecar(sidecar))
            except OSError as err:
                raise StorageError(f"WAL {self.directory}: sidecar write failed: {err}") from err
            with self._lock:
                self._released_seq = released_seq
                self._files = [f for f in self._files if f not in doomed]
            if doomed:
                try:
                    for dead in doomed:
                        dead.path.unlink(missing_ok=True)
                    fsync_dir(self.directory)
                except OSError as err:
                    # The sidecar already says these are released; the next open removes them.
                    logger.warning(
                        "WAL %s: deleting released files failed: %s", self.directory, err
                    )
            return len(doomed)

    # -- reading back ---------------------------------------------------------------------

    def read_data(self, ref: WalRef) -> DataBody:
        """Read one DATA record back from disk, verifying its CRC.

        Raises:
            FormatError: the bytes on disk no longer verify.
            StorageError: the file cannot be read.
        """
        raw, head, name = self._read_record(ref)
        return decode_data(raw, 0, head, name=name)

    def read_entries(self, ref: WalRef) -> list[memoryview]:
        """The entries of one DATA record, as views into one read buffer (no copies).

        Raises:
            FormatError: the bytes on disk no longer verify.
            StorageError: the file cannot be read.
        """
        raw, head, name = self._read_record(ref)
        return decode_data_views(raw, 0, head, name=name)

    def _read_record(self, ref: WalRef) -> tuple[bytes, RecordHead, str]:
        path = self.directory / file_name(ref.file_no)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                raw = os.pread(fd, ref.size, ref.offset)
            finally:
                os.close(fd)
        except OSError as err:
            raise StorageError(f"WAL {path}: read at byte {ref.offset} failed: {err}") from err
        head = decode_record_head(raw, 0, name=path.name)
        if head.type != RecordType.DATA or head.size != ref.size:
            raise FormatError(
                f"{path.name}: record at byte {ref.offset}: expected a DATA record of "
                f"{ref.size} bytes, found type {head.type} of {head.size}",
                field="type",
                offset=ref.offset,
            )
        return raw, head, path.name

    # -- closing --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Sync, close the file and drop the directory lock. Idempotent."""
        with self._sync_lock, self._lock:
            self._close_retired()
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    if self._synced < self._written:
                        _fdatasync(self._fd)
                os.close(self._fd)
                self._fd = -1
            self._closed = True
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # closing the descriptor drops the flock
                self._lock_fd = -1

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"WAL {self.directory}: closed")

    def __enter__(self) -> Wal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Wal({str(self.directory)!r})"


# -- helpers --------------------------------------------------------------------------------


def _fdatasync(fd: int) -> None:
    """``fdatasync``, a module-level name so tests can stall it to model a slow disk."""
    os.fdatasync(fd)


def _drop_cached(fd: int, end: int) -> None:
    """Let the kernel drop the page cache of a file's first ``end`` bytes, just made durable.

    A WAL's bytes are written once and read back only when a batch outgrew the memory budget
    or after a crash, so keeping them cached only takes memory from the process and the disk
    cache of whatever shares the machine (PostgreSQL does the same with its WAL segments).
    Clean pages are dropped; pages still being written are left as they are.
    """
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, end, os.POSIX_FADV_DONTNEED)


def _lock_directory(directory: Path) -> int:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(
                "wal_dir",
                f"expected a WAL directory no other producer holds, found {directory} locked "
                f"(pid {holder}); one WAL directory belongs to one live producer",
            ) from err
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


_IOV_MAX = 1024  # the POSIX minimum for IOV_MAX; Linux has exactly this


def _write_parts(fd: int, parts: list[bytes], total: int) -> None:
    """``writev`` the parts (no copy in user space); finish a short write with ``write``."""
    written = 0
    for start in range(0, len(parts), _IOV_MAX):
        chunk = parts[start : start + _IOV_MAX]
        expected = sum(map(len, chunk))
        done = os.writev(fd, chunk)
        if done != expected:
            write_all(fd, b"".join(chunk)[done:])
        written += expected
    assert written == total


def _replace_file(directory: Path, name: str, data: bytes) -> None:
    """temp → fsync → rename → fsync the directory: readers see the old or the new bytes."""
    temp = directory / f"{name}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, directory / name)
    fsync_dir(directory)
