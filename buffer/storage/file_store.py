"""A local-directory object store with a real compare-and-swap.

obstore's ``LocalStore`` cannot do a conditional update, so ``file://`` stores are served
here. A conditional write takes an exclusive ``flock`` on a per-object lock file (removed
again on release, so none is left behind), compares the current content's ETag, writes a temp
file, fsyncs it, renames it over the target and fsyncs the directory. ``flock`` is shared by
every process on the host, so several producers on one machine can append to the same manifest
safely. Reads need no lock: ``rename`` is atomic, so a
reader sees either the old or the new object, never a mix.

The ETag is a hash of the content. Two different states of a manifest never have the same
bytes (``next_sequence`` and ``epoch`` only grow), so an ETag match means the state is the one
that was read. Hashing an 82 MB manifest on every fencing check is what made a long backlog
slow here, so each write also records the hash in an extended attribute of the file
(``user.millpond.etag``: the hash, the size and the modification time it was written with),
and a read takes the ETag from there, without reading the content, whenever size and time
still match (an edit by hand changes the time: the content is hashed again). Where the file
system keeps no user attributes the hash is computed as before: slower, the same ETag. So a
version check (:meth:`FileStore.get_if_changed`, :meth:`FileStore.get_tail`, the comparison
of :meth:`FileStore.put_if_match`) costs an ``fstat`` and a ``getxattr``, and a tail read
reads only the tail.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from millpond.errors import (
    CommitStateUnknownError,
    ConfigError,
    ConflictError,
    NotFoundError,
    StorageError,
)
from millpond.storage.store import DeleteFailure, GetResult, ObjectInfo, ObjectStore

__all__ = ["FileStore", "fsync_dir", "write_all"]

# Lock and temp files start with a dot and are never listed as objects.
_HIDDEN = "."
# The content hash a write recorded, with the size and modification time it recorded it at.
_ETAG_ATTR = "user.millpond.etag"
# A file system that keeps no user attributes (or refuses them here): hash the content.
_NO_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENOSPC, errno.E2BIG)


class FileStore(ObjectStore):
    """An :class:`ObjectStore` rooted at a local directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # Nothing is created until the first write: a mistyped path opened by a read-only
        # command must not leave a directory behind.
        self._root = Path(root).resolve()
        self.url = self._root.as_uri()

    def location(self) -> str:
        return f"file:{self._root}"

    @property
    def is_local(self) -> bool:
        return True

    def exists(self) -> bool:
        """Whether the root directory exists (it is created by the first write)."""
        return self._root.is_dir()

    @classmethod
    def from_url(cls, url: str) -> FileStore:
        """Open ``file:///absolute/path``.

        Raises:
            ConfigError: a relative or malformed URL.
        """
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ConfigError("store", f"expected file:///absolute/path, found {url!r}")
        return cls(path)

    def get(self, path: str) -> GetResult:
        with self._open(path) as fd:
            recorded = _recorded_etag(fd)
            data = _read_all(fd, path)
        return GetResult(data=data, etag=recorded or _etag(data))

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        with self._open(path) as fd:
            recorded = _recorded_etag(fd)
            if etag is not None and recorded == etag:
                return None  # unchanged, told without reading it
            data = _read_all(fd, path)
        current = recorded or _etag(data)
        return None if etag is not None and current == etag else GetResult(data, current)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        """The last ``length`` bytes, read alone when the write recorded its ETag; the ETag
        and the bytes come from one file (one version: a write renames a new file in)."""
        with self._open(path) as fd:
            recorded = _recorded_etag(fd)
            if recorded is None:
                data = _read_all(fd, path)
                current = _etag(data)
                if etag is not None and current == etag:
                    return None
                return GetResult(data=data[-length:] if length else b"", etag=current)
            if etag is not None and recorded == etag:
                return None
            size = os.fstat(fd).st_size
            start = max(0, size - length)
            return GetResult(data=_pread_all(fd, size - start, start, path), etag=recorded)

    def head(self, path: str) -> ObjectInfo:
        target = self._path(path)
        try:
            stat = target.stat()
        except FileNotFoundError as err:
            raise NotFoundError(f"{path}: not found") from err
        return _info(path, stat)

    def put(self, path: str, data: bytes) -> str | None:
        target = self._path(path)
        with self._locked(target):
            return self._replace(target, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        target = self._path(path)
        with self._locked(target):
            if target.exists():
                raise ConflictError(f"{path}: already exists")
            return self._replace(target, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        target = self._path(path)
        with self._locked(target):
            try:
                fd = os.open(target, os.O_RDONLY)
            except FileNotFoundError as err:
                raise ConflictError(f"{path}: vanished since ETag {etag} was read") from err
            try:
                current = _recorded_etag(fd) or _etag(_read_all(fd, path))
            finally:
                os.close(fd)
            if current != etag:
                raise ConflictError(f"{path}: changed since ETag {etag} was read")
            return self._replace(target, data)

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        base = self._path(prefix) if prefix.strip("/") else self._root
        if not base.is_dir():
            return []
        found: builtins.list[ObjectInfo] = []
        for directory, names in self._walk(base, recursive):
            for name in names:
                full = directory / name
                try:
                    stat = full.stat()
                except FileNotFoundError:
                    continue  # deleted while we listed
                found.append(_info(full.relative_to(self._root).as_posix(), stat))
        return found

    def list_range(
        self, prefix: str = "", *, start_after: str | None = None, end_before: str | None = None
    ) -> Iterator[ObjectInfo]:
        """Reads the directory's names (no ``stat``) and stats only those in range."""
        base = self._path(prefix) if prefix.strip("/") else self._root
        if not base.is_dir():
            return
        folder = base.relative_to(self._root).as_posix()
        lead = f"{folder}/" if folder != "." else ""
        wanted: builtins.list[str] = []
        with os.scandir(base) as entries:
            for entry in entries:
                path = lead + entry.name
                if (
                    (start_after is None or path > start_after)
                    and (end_before is None or path < end_before)
                    and not entry.name.startswith(_HIDDEN)
                    and entry.is_file()
                ):
                    wanted.append(entry.name)
        wanted.sort()
        for name in wanted:
            try:
                stat = os.stat(base / name)
            except FileNotFoundError:
                continue  # deleted while we listed
            yield _info(lead + name, stat)

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        failures: builtins.list[DeleteFailure] = []
        touched: set[Path] = set()
        for path in paths:
            try:
                target = self._path(path)
                if not target.parent.is_dir():
                    continue  # nothing there, and nothing to create
                # Under the object's lock, so a delete never interleaves with a conditional
                # write of the same name; the lock file goes too.
                with self._locked(target):
                    target.unlink(missing_ok=True)
                touched.add(target.parent)
            except (OSError, ConfigError) as err:
                failures.append(DeleteFailure(path=path, reason=str(err)))
        for directory in touched:
            fsync_dir(directory)
        return failures

    @contextlib.contextmanager
    def _open(self, path: str) -> Iterator[int]:
        """The object's file, open for reading: whatever is renamed over it meanwhile, every
        read through it sees this one version."""
        try:
            fd = os.open(self._path(path), os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as err:
            raise NotFoundError(f"{path}: not found") from err
        except OSError as err:
            raise StorageError(f"{path}: {err}") from err
        try:
            yield fd
        finally:
            os.close(fd)

    def _path(self, path: str) -> Path:
        clean = path.strip("/")
        parts = clean.split("/")
        if not clean or any(p in ("", ".", "..") or p.startswith(_HIDDEN) for p in parts):
            raise ConfigError("path", f"expected a relative object path, found {path!r}")
        return self._root.joinpath(*parts)

    def _walk(self, base: Path, recursive: bool) -> Iterator[tuple[Path, builtins.list[str]]]:
        if not recursive:
            with os.scandir(base) as entries:
                names = [e.name for e in entries if e.is_file() and not e.name.startswith(_HIDDEN)]
            yield base, names
            return
        for directory, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(_HIDDEN)]
            yield Path(directory), [f for f in files if not f.startswith(_HIDDEN)]

    @contextlib.contextmanager
    def _locked(self, target: Path) -> Iterator[None]:
        """Hold the object's lock file; remove it on release, so none is left behind.

        A waiter may have opened the file before its holder removed it: after taking the lock
        it checks that the path still names the file it locked, and starts over otherwise, so
        two writers never hold locks on two different files for one object.
        """
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_path = target.parent / f"{_HIDDEN}{target.name}.lock"
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    current = os.stat(lock_path)
                except FileNotFoundError:
                    current = None
                locked = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            if current is not None and (current.st_ino, current.st_dev) == (
                locked.st_ino,
                locked.st_dev,
            ):
                break
            os.close(fd)  # removed (or replaced) by the holder we waited for: start over
        try:
            yield
        finally:
            # Removed while still locked: a waiter on this file then sees it is gone.
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
            os.close(fd)  # closing drops the flock

    @staticmethod
    def _replace(target: Path, data: bytes) -> str:
        """Write ``data`` over ``target`` (temp file, fsync, rename, directory fsync); returns
        its ETag, recorded on the file for cheap version checks."""
        temp = target.parent / f"{_HIDDEN}{target.name}.{uuid.uuid4().hex}.tmp"
        etag = _etag(data)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, data)
                _record_etag(fd, etag)
                # The data must be on disk before the rename publishes it.
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, target)
        except OSError as err:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise StorageError(f"{target}: write failed: {err}") from err
        # fsync the directory too, or the rename can be lost on power failure.
        try:
            fsync_dir(target.parent)
        except OSError as err:
            raise CommitStateUnknownError(f"{target}: directory fsync failed: {err}") from err
        return etag


def _etag(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _record_etag(fd: int, etag: str) -> None:
    """Record ``etag`` on the file written through ``fd`` with its size and modification time
    (setting an attribute changes neither); nothing where the file system keeps none."""
    stat = os.fstat(fd)
    try:
        os.setxattr(fd, _ETAG_ATTR, f"{etag} {stat.st_size} {stat.st_mtime_ns}".encode())
    except OSError as err:
        if err.errno not in _NO_XATTR:
            raise


def _recorded_etag(fd: int) -> str | None:
    """The ETag the write of this file recorded, if its size and modification time are still
    the ones it recorded; ``None`` otherwise (hash the content)."""
    try:
        recorded = os.getxattr(fd, _ETAG_ATTR).decode("ascii", "replace").split()
    except OSError:
        return None  # none recorded (an older write, a copy, a file system without them)
    stat = os.fstat(fd)
    if len(recorded) != 3 or recorded[1:] != [str(stat.st_size), str(stat.st_mtime_ns)]:
        return None
    return recorded[0]


def _read_all(fd: int, path: str) -> bytes:
    size = os.fstat(fd).st_size
    return _pread_all(fd, size, 0, path) if size else b""


def _pread_all(fd: int, length: int, offset: int, path: str) -> bytes:
    """``length`` bytes at ``offset``; a file cut shorter meanwhile (never by millpond: writes
    rename a new file in) is a storage error."""
    chunks: list[bytes] = []
    try:
        while length > 0:
            chunk = os.pread(fd, length, offset)
            if not chunk:
                raise StorageError(f"{path}: ended {length} bytes early while being read")
            chunks.append(chunk)
            length -= len(chunk)
            offset += len(chunk)
    except IsADirectoryError as err:
        raise NotFoundError(f"{path}: not found") from err
    except OSError as err:
        raise StorageError(f"{path}: {err}") from err
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _info(path: str, stat: os.stat_result) -> ObjectInfo:
    mtime = datetime.fromtimestamp(stat.st_mtime, tz=UTC)
    return ObjectInfo(path=path, size=stat.st_size, last_modified=mtime)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(directory: Path) -> None:
    """fsync a directory: a rename or delete in it is not durable until then."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
