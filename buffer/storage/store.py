"""The object-store interface millpond needs, and which store URLs it takes.

Everything millpond does to storage goes through :class:`ObjectStore`: plain and conditional
puts, gets with the ETag, listing and multi-delete. Two implementations exist: one over obstore
(S3, Azure Blob, GCS, memory; ``obstore_store.py``, the only module importing obstore)
and one over the local file system with a compare-and-swap of its own (``file_store.py``),
because obstore's ``LocalStore`` cannot do a conditional update. Both import this module, so a
store is opened from a URL elsewhere (:func:`millpond.storage.open_store`, in ``open.py``).
"""

from __future__ import annotations

import builtins
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

from millpond.errors import ConfigError, NotFoundError
from millpond.storage._backends import BACKENDS, check_bucket_name

__all__ = [
    "NETWORK_SCHEMES",
    "STORE_URL_FORMS",
    "STORE_URL_SCHEMES",
    "DeleteFailure",
    "ForwardingStore",
    "GetResult",
    "ObjectInfo",
    "ObjectStore",
    "check_store_url",
    "get_or_none",
]


@dataclass(frozen=True, slots=True)
class GetResult:
    """An object's bytes with the ETag they were read at."""

    data: bytes
    etag: str | None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object. ``path`` is relative to the store root."""

    path: str
    size: int
    last_modified: datetime | None = None
    etag: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteFailure:
    """An object a multi-delete could not remove, and why."""

    path: str
    reason: str


class ObjectStore(ABC):
    """A bucket (or directory) with the operations the queue, producer and GC need.

    Implementations are thread-safe. Paths are ``/``-separated and relative to the root.
    """

    url: str
    """Where the store points, without credentials."""

    @abstractmethod
    def get(self, path: str) -> GetResult:
        """Read a whole object.

        Raises:
            NotFoundError: no object at ``path``.
            StorageError: the store failed.
        """

    @abstractmethod
    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        """Read an object unless its ETag is still ``etag``; ``None`` means unchanged.

        Raises:
            NotFoundError: no object at ``path``.
            StorageError: the store failed.
        """

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        """The last ``length`` bytes of an object, unless its ETag is still ``etag``.

        ``None`` means unchanged. The ETag returned is the whole object's, and the bytes are
        that version's. Stores that can ask for a suffix range with a precondition do so in one
        request (the consumer checks the manifest's epoch this way on every call: a 304, or 22
        bytes); Azure Blob, which takes no suffix range, in a conditional HEAD (the 304) and,
        when the object changed, a range pinned to the HEAD's ETag.

        Raises:
            NotFoundError: no object at ``path``.
            StorageError: the store failed.
        """
        got = self.get_if_changed(path, etag)
        if got is None:
            return None
        return GetResult(data=got.data[-length:], etag=got.etag)

    @abstractmethod
    def head(self, path: str) -> ObjectInfo:
        """Size, time and ETag of one object.

        Raises:
            NotFoundError: no object at ``path``.
            StorageError: the store failed.
        """

    @abstractmethod
    def put(self, path: str, data: bytes) -> str | None:
        """Write an object unconditionally; returns its ETag.

        Raises:
            StorageError: the store failed; the write may or may not have landed.
        """

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes) -> str | None:
        """Create an object only if nothing is at ``path``; returns its ETag.

        Raises:
            ConflictError: an object already exists (possibly our own write, if a retried
                request is what found it).
            CommitStateUnknownError: the request failed after it may have landed.
            StorageError: the store failed before sending.
        """

    @abstractmethod
    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        """Replace an object only if its ETag is still ``etag``; returns the new ETag.

        Raises:
            ConflictError: the object changed (or vanished) since ``etag`` was read.
            CommitStateUnknownError: the request failed after it may have landed.
        """

    def copy(self, source: str, target: str) -> None:
        """Copy an object to another name, overwriting it (server-side where the store can).

        Raises:
            NotFoundError: no object at ``source``.
            StorageError: the store failed; the copy may or may not have been made.
        """
        self.put(target, self.get(source).data)

    @abstractmethod
    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        """Objects under ``prefix`` (a path segment, not a string prefix).

        With ``recursive=False`` only objects directly under ``prefix`` are returned.

        Raises:
            StorageError: the store failed.
        """

    def list_range(
        self, prefix: str = "", *, start_after: str | None = None, end_before: str | None = None
    ) -> Iterator[ObjectInfo]:
        """Objects directly under ``prefix`` whose path lies strictly between ``start_after``
        and ``end_before`` (either ``None``: unbounded), in path order, as they are listed.

        A store that lists in path order (S3, GCS, Azure Blob, memory) starts at
        ``start_after`` and stops at ``end_before``, so a bounded range costs what it holds,
        not the whole prefix; the file store reads the names of the directory and looks
        closer only at those in range. Garbage collection lists only below the queue's floor
        this way. This default lists the prefix (:meth:`list`, so a wrapper's ``list`` is the
        one used) and filters.

        Raises:
            StorageError: the store failed (possibly after some objects were yielded).
        """
        found = [
            info
            for info in self.list(prefix, recursive=False)
            if (start_after is None or info.path > start_after)
            and (end_before is None or info.path < end_before)
        ]
        yield from sorted(found, key=lambda info: info.path)

    @abstractmethod
    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        """Delete objects in bulk; a missing object counts as deleted.

        Returns:
            The objects that could not be deleted, each with the reason; an empty list
            when all went.
        """

    @property
    def supports_conditional_update(self) -> bool:
        """Whether ``put_if_match`` is a true compare-and-swap on this store."""
        return True

    def credential_source(self) -> str:
        """Where this store's credentials come from, named without their values."""
        return "none needed (a local store)"

    @property
    def is_local(self) -> bool:
        """Whether the store lives in this process or on this machine (memory, ``file://``):
        no credentials, no bucket, and conditional writes of millpond's own."""
        return False

    def location(self) -> str:
        """Where this store's objects are, credentials left out: two stores whose locations
        are equal on one machine hold the same objects (an endpoint and a bucket, a
        directory). When that cannot be told, a name of this very store object in this
        process, equal to no other store's."""
        return f"{type(self).__name__}@{os.getpid()}:{id(self)}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def get_or_none(store: ObjectStore, path: str) -> GetResult | None:
    """``store.get(path)``, or ``None`` when there is no object at ``path``.

    Raises:
        StorageError: the store failed.
    """
    try:
        return store.get(path)
    except NotFoundError:
        return None


class ForwardingStore(ObjectStore):
    """Passes every call to ``inner``; subclass it to count, delay or fail chosen calls."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url

    def get(self, path: str) -> GetResult:
        return self.inner.get(path)

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        return self.inner.get_if_changed(path, etag)

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        return self.inner.get_tail(path, length, etag)

    def head(self, path: str) -> ObjectInfo:
        return self.inner.head(path)

    def put(self, path: str, data: bytes) -> str | None:
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self.inner.put_if_match(path, data, etag)

    def copy(self, source: str, target: str) -> None:
        self.inner.copy(source, target)

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        return self.inner.list(prefix, recursive=recursive)

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        return self.inner.delete_many(paths)

    @property
    def supports_conditional_update(self) -> bool:
        return self.inner.supports_conditional_update

    def credential_source(self) -> str:
        return self.inner.credential_source()

    @property
    def is_local(self) -> bool:
        return self.inner.is_local

    def location(self) -> str:
        return self.inner.location()


STORE_URL_FORMS = (
    "an s3://bucket[/root], az://container[/root], gs://bucket[/root], file:///path or "
    "memory:// URL"
)
"""What a store URL may look like, for error messages and help texts."""
STORE_URL_SCHEMES = (*BACKENDS, "file", "memory")
"""Every scheme :func:`~millpond.storage.open.open_store` opens."""
NETWORK_SCHEMES = tuple(BACKENDS)
"""The schemes of stores reached over the network (S3, Azure, GCS): a request costs a round
trip, not microseconds."""


def check_store_url(url: str) -> None:
    """Refuse a store URL :func:`~millpond.storage.open.open_store` would not open, or would
    open somewhere else.

    A ``?`` or ``#`` would end the root there (``s3://b/q?x`` and ``s3://b/q#y`` are both the
    queue at ``s3://b/q``): two queues meant to be apart would silently be one.

    A bucket or container name no store of the backend could have (``s3://my_bucket!/q``) is
    refused before any request, naming the rule (the store would answer with a signature
    error, which reads as wrong credentials).

    Raises:
        ConfigError: an unsupported scheme, a query or fragment, or a bucket name no store
            could have.
    """
    scheme = urlsplit(url).scheme
    if scheme not in STORE_URL_SCHEMES or "://" not in url:
        raise ConfigError("store", f"expected {STORE_URL_FORMS}, found {_redact(url)!r}")
    if "?" in url or "#" in url:
        raise ConfigError(
            "store",
            f"{_redact(url)!r}: a store URL takes no '?' or '#' (the root would end there); "
            "write one that belongs to the root as %3F or %23, and give options as store "
            "options (--store-option KEY=VALUE)",
        )
    check_bucket_name(_redact(url))


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password or parts.username:
        netloc = parts.hostname or ""
        return parts._replace(netloc=netloc).geturl()
    return url
