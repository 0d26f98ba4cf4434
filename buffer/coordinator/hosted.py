"""One append coordinator per queue and machine, hosted by one of the producers on it.

Producers that append directly each take a compare-and-swap of their own, and at 50 ms a
request one manifest takes about fifteen a second whoever writes them: eight producers each
wait for a turn about every half second (issue 11). A ``millpond coordinator`` appends every
waiting producer's batches in one compare-and-swap per round, but it is a service someone must
run. By default on S3, GCS and Azure (``ProducerConfig.host_coordinator``,
:func:`shares_a_coordinator`) the producers of a queue on one machine — the Python workers of
a Spark executor, several jobs on one edge node — elect one of themselves to host that
coordinator, and the others send their appends to it:

* **Election** is a lock on a file named for the queue (``flock``, non-blocking) in a
  directory private to the user (``MILLPOND_RUN_DIR``, else ``$TMPDIR/millpond-<uid>``). The
  process that holds it serves an :class:`~millpond.coordinator.rounds.AppendCoordinator` on
  127.0.0.1 (a free port) and writes its URL and a random token into the file; the others read
  both there and send the token with every request. The coordinator refuses a request without
  it (``403``), so only processes that can read the user's private directory append through
  it. The kernel releases the lock when the holder exits, however it ends. On a file system
  without ``flock`` (some NFS mounts) nobody is elected: the producer says so once, naming
  the file, and appends directly.
* **Nothing new to trust.** The hosted coordinator is the one ``millpond coordinator`` serves,
  reached through the same client (:mod:`millpond.coordinator.client`): when it is
  unreachable, refuses, or its reply is lost, a producer appends directly under the same
  promises (the landed-check; no write of a request after its budget). Two coordinators of one
  queue are harmless (they contend like producers), so a stale URL or a lock taken over
  mid-round costs latency, never an entry.
* **Take-over.** A producer that is not the host tries the lock again before an append, at most
  once a second; when the host has gone, the first to try hosts the next coordinator. Until
  then the others append directly. A host killed mid-round leaves its clients waiting out the
  coordinator's promise (``budget`` plus ``grace``, 5 s by default) before they look and append
  directly; a host that closes finishes its round and refuses the rest, which go directly at
  once.

The lock is per open file, so two producers in one process elect like two processes. A fork
copies the lock's descriptor, and the lock is held while any copy is open: a child that
outlived a host (a worker pool, a daemon) would keep the coordinator from ever moving. A forked
child therefore closes its copies at once (``os.register_at_fork``); it has none of the host's
threads anyway, and its parent's producer refuses to be used there.

**Trust.** A URL read from the election file decides where a producer's appends go, and a
coordinator's ``appended`` is taken at its word: the directory must be this user's own and
writable by nobody else (a directory someone else made under a shared ``/tmp`` is refused),
and only a ``http://127.0.0.1:<port>`` URL is followed. Whatever goes wrong with the election
(the directory refused or not writable, no free port) is logged once and the producer appends
directly; it never stops a producer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
import tempfile
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from millpond.common.clock import Clock
from millpond.coordinator.client import CoordinatedAppender
from millpond.coordinator.connection import CoordinatorOptions, Endpoint
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.formats.manifest import PendingEntry
from millpond.queue.append import QueueProducer
from millpond.storage.store import NETWORK_SCHEMES, ObjectStore

__all__ = [
    "HostCoordinatedAppender",
    "HostCoordinator",
    "election_path",
    "run_dir",
    "shares_a_coordinator",
]

logger = logging.getLogger(__name__)

RUN_DIR_ENV = "MILLPOND_RUN_DIR"
_RETRY_LOCK = 1.0  # seconds between two tries of the lock by a producer that does not hold it
_HELD = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
"""What ``flock`` fails with when another open file holds the lock."""
_HOSTED = re.compile(r"(http://127\.0\.0\.1:[0-9]{1,5}) ([0-9a-f]{32})")
"""What a host writes into the election file: its URL and its token."""


def shares_a_coordinator(chosen: bool | None, store: ObjectStore) -> bool:
    """Whether a producer on ``store`` shares this machine's coordinator of its queue:
    ``chosen`` (``ProducerConfig.host_coordinator``) when given, else when the store is S3,
    GCS or Azure. A file or memory store takes a compare-and-swap in microseconds: there is
    nothing to share, and no port to open for it."""
    if chosen is not None:
        return chosen
    return urlsplit(store.url).scheme in NETWORK_SCHEMES


def run_dir() -> Path:
    """Where the election files live: ``MILLPOND_RUN_DIR``, else a directory of this user's
    under the temporary directory."""
    chosen = os.environ.get(RUN_DIR_ENV)
    if chosen:
        return Path(chosen)
    return Path(tempfile.gettempdir()) / f"millpond-{os.getuid()}"


_hosts: weakref.WeakSet[HostCoordinator] = weakref.WeakSet()
"""Every host coordinator of this process, for a forked child to let go of their locks."""


def _let_go_in_child() -> None:
    for host in list(_hosts):
        host._forget()


os.register_at_fork(after_in_child=_let_go_in_child)


def election_path(queue: str, location: str) -> Path:
    """The election file of the queue whose identity is ``queue``
    (:func:`~millpond.queue.claim.queue_identity`) in the store at ``location``
    (``ObjectStore.location``): the identity names no endpoint, and two servers on one
    machine may each have a bucket of that name — their producers must not share a
    coordinator, which would append one store's batches to the other's manifest."""
    digest = hashlib.sha256(f"{queue}\n{location}".encode()).hexdigest()[:32]
    return run_dir() / f"coordinator-{digest}.lock"


class HostCoordinator:
    """This machine's coordinator of one queue: hosted here while this process holds the
    queue's lock, else found at the URL its host wrote (module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        manifest_path: str,
        *,
        data_path_prefix: str,
        queue: str,
        clock: Clock,
    ) -> None:
        self._store = store
        self._manifest_path = manifest_path
        self._data_path_prefix = data_path_prefix
        self._queue = queue
        self._clock = clock
        self.path = election_path(queue, store.location())
        self._directory = self.path.parent
        self._fd: int | None = None
        self._server: CoordinatorServer | None = None
        self._token = ""
        self._tried_at = float("-inf")
        self._warned = False
        self._trusted: bool | None = None  # whether the directory passed its check
        _hosts.add(self)

    @property
    def hosting(self) -> bool:
        """Whether this process hosts the coordinator."""
        return self._server is not None

    def endpoint(self) -> tuple[str, str] | None:
        """The coordinator's URL and token (hosting it here when nobody does), or ``None``
        when none is known yet."""
        if self._trusted is None:
            try:
                self._check_directory()
                self._trusted = True
            except OSError as err:
                self._trusted = False
                self._warn(f"no host coordinator ({err}); appending directly")
        if not self._trusted:
            return None
        if self._server is None:
            now = self._clock.monotonic()
            if now - self._tried_at >= _RETRY_LOCK:
                self._tried_at = now
                try:
                    self._try_to_host()
                except OSError as err:
                    self._warn(f"cannot host a coordinator ({err}); appending directly")
                    return None
        if self._server is not None:
            return self._server.url, self._token
        text = self._file_text()
        if text is None:
            return None
        found = _HOSTED.fullmatch(text)
        return (found.group(1), found.group(2)) if found else None

    def _file_text(self) -> str | None:
        """The election file's text, or ``None`` when it cannot be read."""
        try:
            return self.path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None

    def gone(self, at: tuple[str, str]) -> bool:
        """Whether the coordinator at ``at`` (URL, token) can start no write any more: its
        host let go of the lock, which the kernel does only once the process is dead or it
        closed the coordinator (after its last round). Proof: another host's URL (or none)
        in the file, or the lock free. ``False`` while anyone holds it — the same host, alive
        but slow, or the next one about to write its URL."""
        if self._server is not None:
            return (self._server.url, self._token) != at
        text = self._file_text()
        if text is None:
            return False
        found = _HOSTED.fullmatch(text)
        if found is None or (found.group(1), found.group(2)) != at:
            # Written (or emptied) only by whoever holds the lock: the host at ``at`` let go.
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held
        finally:
            os.close(fd)  # a lock taken here is let go at once: this process hosts nothing
        return True

    def close(self) -> None:
        """Stop hosting (the round under way finishes, waiting requests are refused and go
        directly), and let another process take the lock."""
        server, self._server = self._server, None
        fd, self._fd = self._fd, None
        if server is not None:
            server.close()
        if fd is not None:
            # Readers find no URL until the next host writes one (a stale URL would only
            # send them to a direct append after a failed connection).
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # releases the lock

    def _forget(self) -> None:
        """In a forked child: close this process's copy of the lock (the parent still holds
        it), and host nothing (the server's threads did not come along)."""
        fd, self._fd = self._fd, None
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.close_inherited()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("%s: %s", self._queue, message)

    def _check_directory(self) -> None:
        self._directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = os.lstat(self._directory)
        if (
            not stat.S_ISDIR(found.st_mode)
            or found.st_uid != os.getuid()
            or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise PermissionError(
                f"{self._directory} is not a directory of this user's that only it can write "
                f"(set {RUN_DIR_ENV} to one)"
            )

    def _try_to_host(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in _HELD:
                return  # held by another producer: read its URL
            # A file system without flock (some NFS mounts): no election can be held here.
            raise OSError(err.errno, f"cannot lock {self.path}: {err.strerror}") from err
        try:
            coordinator = AppendCoordinator(
                self._store,
                self._manifest_path,
                data_path_prefix=self._data_path_prefix,
                queue=self._queue,
                clock=self._clock,
            )
            token = secrets.token_hex(16)
            server = CoordinatorServer(coordinator, "127.0.0.1", 0, token=token).start()
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{server.url} {token}\n".encode("ascii"), 0)
        except BaseException:
            server.close()
            os.close(fd)
            raise
        self._fd, self._server, self._token = fd, server, token
        logger.info(
            "hosting the coordinator of %s for this machine's producers on %s (%s)",
            self._queue,
            server.url,
            self.path,
        )


class HostCoordinatedAppender(CoordinatedAppender):
    """Appends through this machine's coordinator of the queue (:class:`HostCoordinator`),
    directly whenever it cannot help; the contract of ``QueueProducer.append``."""

    def __init__(
        self,
        direct: QueueProducer,
        host: HostCoordinator,
        *,
        queue: str,
        clock: Clock,
    ) -> None:
        super().__init__(direct, (), queue=queue, clock=clock)
        self._host = host
        self._at: tuple[str, str] | None = None

    def append(
        self,
        entries: Sequence[PendingEntry],
        *,
        more: Callable[[], Sequence[PendingEntry]] | None = None,
        deadline: float | None = None,
        in_doubt_from: int | None = None,
    ) -> tuple[int, ...]:
        at = self._host.endpoint()
        if at != self._at:
            # Another host now (or none known): what was seen through the old one still bounds
            # where our entries can be, so it is kept.
            super().close()
            self._at = at
            self._endpoints = []
            if at is not None:
                url, token = at
                self._options = CoordinatorOptions(token=token)
                self._endpoints = [Endpoint(url, self._options)]
                self._gone = partial(self._host.gone, at)
        return super().append(entries, more=more, deadline=deadline, in_doubt_from=in_doubt_from)

    def close(self) -> None:
        super().close()
        self._host.close()
