"""The obstore adapter: the only module that imports obstore.

obstore's exceptions are translated here into the millpond error tree, with ``raise ... from``:
a refusal that retrying cannot fix (no or rejected credentials, a missing bucket or container,
no permission) becomes :class:`~millpond.errors.StoreAccessError`, so no retry loop spins on
it; network failures and 5xx stay :class:`~millpond.errors.StorageError`.

Conditional writes map onto obstore's put modes: ``"create"`` for create-if-absent (S3 and
Azure send ``If-None-Match: *``, GCS ``x-goog-if-generation-match: 0``) and an update version
for update-if-unchanged (S3 and Azure ``If-Match: <etag>``; S3 needs
``aws_conditional_put="etag"``; GCS ``x-goog-if-generation-match: <generation>``, so on GCS the
"ETag" this adapter hands out is the object generation).
"""

from __future__ import annotations

import builtins
import itertools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn, TypeVar, cast
from urllib.parse import urlsplit

import obstore
from obstore import exceptions as obx
from obstore.store import AzureStore, GCSStore, MemoryStore, S3Store

from millpond.errors import (
    CommitStateUnknownError,
    ConfigError,
    ConflictError,
    NotFoundError,
    StorageError,
    StoreAccessError,
)
from millpond.storage._backends import backend_of, bucket_name_problem, prepare, rejection
from millpond.storage.store import DeleteFailure, GetResult, ObjectInfo, ObjectStore

__all__ = ["ObstoreStore"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# What obstore raises for store and network failures; anything else is a bug and propagates.
_STORE_ERRORS = (obx.BaseError, OSError)
# S3 DeleteObjects takes at most 1000 keys per request.
_DELETE_CHUNK = 1000
_DELETE_FALLBACK_THREADS = 8
# obstore retries 5xx and connection errors itself; keep that short so millpond's own loops,
# which re-read and check what landed, stay in charge of long outages.
_DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 3,
    "retry_timeout": timedelta(seconds=10),
    "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2)},
}
_SECRET_WORDS = ("secret", "key", "token", "password", "sas", "credential")
"""Parts of the names of obstore options that hold credentials (left out of ``location``)."""
_DEFAULT_CLIENT: dict[str, Any] = {
    "connect_timeout": timedelta(seconds=5),
    "timeout": timedelta(seconds=120),
}
# Error codes in a store's answer that no retry fixes, by what is wrong.
_MISSING_BUCKET = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
_BAD_CREDENTIALS = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidClientTokenId",
    "ExpiredToken",
    "AuthenticationFailed",
    "InvalidAuthenticationInfo",
    "NoAuthenticationInformation",
    "failed to authenticate",
)
# Failures to fetch credentials: obstore names the provider or the metadata endpoint it asked.
_NO_CREDENTIALS = re.compile(
    r"latest/api/token|latest/meta-data|metadata/identity|computeMetadata|"
    r"credential|Missing (SecretAccessKey|AccessKeyId)|OAuth|token provider",
    re.IGNORECASE,
)
# A store's XML error body, and the HTTP status obstore reports.
_XML_CODE = re.compile(r"<Code>([^<]+)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_STATUS = re.compile(r"status code: (\d{3})")
# Signed URLs in error text must not reach a log: drop their signature and credential.
_SECRET_PARAMS = re.compile(
    r"(?i)\b(sig|x-amz-signature|x-amz-credential|x-goog-signature)=[^&\s]+"
)


class ObstoreStore(ObjectStore):
    """An :class:`ObjectStore` over any obstore store (S3, memory, ...)."""

    def __init__(
        self,
        store: Any,
        url: str,
        *,
        backend: str = "",
        credential_source: str = "",
        credential_hint: str = "",
        credential_parts: Mapping[str, str] | None = None,
    ) -> None:
        self._store = store
        self.url = url
        self._backend = backend
        self._credential_source = credential_source or "whatever the store object was built with"
        self._hint = credential_hint
        self._parts = dict(credential_parts or {})
        # GCS's conditional update is on the object generation, not the ETag: there the
        # "ETag" millpond hands out is the generation.
        self._generations = backend == "gcs"

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, str] | None = None) -> ObstoreStore:
        """Open ``s3://bucket[/root]``, ``az://container[/root]``, ``gs://bucket[/root]`` or
        ``memory://``.

        Raises:
            ConfigError: an unknown option or a malformed URL.
        """
        parts = urlsplit(url)
        if parts.scheme == "memory":
            return cls(_named_memory_store(parts.netloc + parts.path), url)
        backend = backend_of(url)
        if backend is None:
            raise ConfigError("store", f"expected s3://, az:// or gs://, found {url!r}")
        prepared = prepare(backend, options)
        builder: Any = {"s3": S3Store, "azure": AzureStore, "gcs": GCSStore}[backend]
        try:
            # obstore types these as TypedDicts; ours are validated by obstore itself.
            store = builder.from_url(
                url,
                config=cast("Any", prepared.config),
                client_options=cast("Any", {**_DEFAULT_CLIENT, **prepared.client}),
                retry_config=cast("Any", _DEFAULT_RETRY),
            )
        except obx.BaseError as err:
            raise ConfigError("store", f"cannot open {url!r}: {_first_line(err)}") from err
        except (ValueError, TypeError) as err:
            raise ConfigError("store_options", f"cannot open {url!r}: {err}") from err
        return cls(
            store,
            f"{parts.scheme}://{parts.netloc}{parts.path}",
            backend=backend,
            credential_source=prepared.credential_source,
            credential_hint=prepared.credential_hint,
            credential_parts=prepared.credential_parts,
        )

    @classmethod
    def wrap(cls, store: Any) -> ObstoreStore:
        """Adopt an obstore store object the caller built."""
        if not hasattr(store, "put") or not hasattr(store, "get"):
            raise ConfigError(
                "store", f"expected a URL or an obstore store, found {type(store).__name__}"
            )
        prefix = getattr(store, "prefix", None)
        backend = {S3Store: "s3", AzureStore: "azure", GCSStore: "gcs"}.get(type(store), "")
        return cls(store, f"{type(store).__name__}({prefix or ''})", backend=backend)

    @property
    def is_local(self) -> bool:
        return isinstance(self._store, MemoryStore)

    def location(self) -> str:
        store = self._store
        config = getattr(store, "config", None)
        if isinstance(store, MemoryStore) or not isinstance(config, dict):
            # A memory store lives in this process only.
            return f"{type(store).__name__}@{os.getpid()}:{id(store)}"
        # The bucket or container, endpoint, region, account: what names the objects. A
        # secret never names a location, and is not needed to tell two stores apart.
        named = sorted(
            (str(k), str(v))
            for k, v in config.items()
            if not any(word in str(k).lower() for word in _SECRET_WORDS)
        )
        prefix = getattr(store, "prefix", None) or ""
        return f"{self._backend}:{named}:{prefix}"

    def credential_source(self) -> str:
        if isinstance(self._store, MemoryStore):
            return "none needed (in memory)"
        return self._credential_source

    def get(self, path: str) -> GetResult:
        result = self._call(path, lambda: obstore.get(self._store, path))
        data = self._call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=self._token(result.meta))

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        if etag is None:
            return self.get(path)
        if self._generations:
            # The token is a generation, which If-None-Match does not take: compare it.
            got = self.get(path)
            return None if got.etag == etag else got
        try:
            result = obstore.get(self._store, path, options={"if_none_match": etag})
        except obx.NotModifiedError:
            return None
        except _STORE_ERRORS as err:
            self._translate(path, err)
        data = self._call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=self._token(result.meta))

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        if self._backend == "azure":
            return self._get_tail_bounded(path, length, etag)
        options: dict[str, Any] = {"range": {"suffix": length}}
        if etag is not None and not self._generations:
            options["if_none_match"] = etag
        try:
            result = obstore.get(self._store, path, options=cast("Any", options))
        except obx.NotModifiedError:
            return None
        except _STORE_ERRORS as err:
            self._translate(path, err)
        token = self._token(result.meta)
        if etag is not None and self._generations and token == etag:
            return None  # a generation, which If-None-Match does not take: compared here
        data = self._call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=token)

    def _get_tail_bounded(self, path: str, length: int, etag: str | None) -> GetResult | None:
        """:meth:`get_tail` where the store takes no suffix range (Azure Blob: obstore refuses
        ``bytes=-N`` there before sending it): a HEAD for the size, then a bounded range.

        The bytes and the ETag returned must come from one version of the object. The
        consumer's fence check keeps the ETag and sends it as ``If-None-Match`` next time: a
        304 then means "still the version whose footer was checked". A footer read from an
        older version than the ETag kept would let a newer consumer's epoch bump go unseen by
        every later check, and a fenced consumer would go on delivering. So:

        1. the HEAD carries ``If-None-Match: etag``: a 304 is "unchanged" in one request, as
           with the suffix range;
        2. the range GET carries ``If-Match`` with the ETag the HEAD returned, so its bytes
           are that version's or the store answers 412;
        3. on a 412 (a writer replaced the object between the two requests) one whole
           conditional GET: bytes and ETag from a single answer. Not another HEAD and range:
           under a steady stream of appends each such pair can lose its race again, while the
           whole GET always ends in one request (it costs the manifest's size, only then).
        """
        options: dict[str, Any] = {"head": True}
        if etag is not None:
            options["if_none_match"] = etag
        try:
            head = obstore.get(self._store, path, options=cast("Any", options))
        except obx.NotModifiedError:
            return None
        except _STORE_ERRORS as err:
            self._translate(path, err)
        size = int(head.meta["size"])
        version = head.meta.get("e_tag")
        if size == 0 or version is None:
            # Nothing to range over, or no ETag to pin the range to: read it whole.
            return super().get_tail(path, length, etag)
        bounded: dict[str, Any] = {"range": (max(0, size - length), size), "if_match": version}
        try:
            result = obstore.get(self._store, path, options=cast("Any", bounded))
        except obx.PreconditionError:
            return super().get_tail(path, length, etag)
        except _STORE_ERRORS as err:
            self._translate(path, err)
        data = self._call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=self._token(result.meta))

    def head(self, path: str) -> ObjectInfo:
        meta = self._call(path, lambda: obstore.head(self._store, path))
        return self._info(meta)

    def put(self, path: str, data: bytes) -> str | None:
        try:
            result = obstore.put(self._store, path, data, use_multipart=False)
        except _STORE_ERRORS as err:
            self._translate(path, err)
        return self._token(result)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        try:
            result = obstore.put(self._store, path, data, mode="create", use_multipart=False)
        except (obx.AlreadyExistsError, obx.PreconditionError) as err:
            raise ConflictError(f"{path}: already exists") from err
        except _STORE_ERRORS as err:
            self._translate_write(path, err)
        return self._token(result)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        mode: dict[str, str] = {"version": etag} if self._generations else {"e_tag": etag}
        try:
            result = obstore.put(
                self._store, path, data, mode=cast("Any", mode), use_multipart=False
            )
        except (obx.PreconditionError, obx.AlreadyExistsError) as err:
            raise ConflictError(f"{path}: changed since ETag {etag} was read") from err
        except (obx.NotFoundError, FileNotFoundError) as err:
            # A missing bucket is no conflict: it must not send the caller round a CAS loop.
            self._refused(path, err)
            raise ConflictError(f"{path}: vanished since ETag {etag} was read") from err
        except _STORE_ERRORS as err:
            self._translate_write(path, err)
        return self._token(result)

    def copy(self, source: str, target: str) -> None:
        self._call(source, lambda: obstore.copy(self._store, source, target, overwrite=True))

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        clean = prefix.strip("/") or None
        if recursive:
            chunks = self._call(
                prefix, lambda: list(obstore.list(self._store, clean, chunk_size=1000))
            )
            return [self._info(meta) for chunk in chunks for meta in chunk]
        listing = self._call(prefix, lambda: obstore.list_with_delimiter(self._store, clean))
        return [self._info(meta) for meta in listing["objects"]]

    def list_range(
        self, prefix: str = "", *, start_after: str | None = None, end_before: str | None = None
    ) -> Iterator[ObjectInfo]:
        """One paged listing from ``start_after`` (S3's start-after; GCS, Azure and memory
        list in path order too), stopped at ``end_before``; nested objects are skipped."""
        clean = prefix.strip("/")
        offset = start_after if start_after is not None and start_after > clean else None
        stream = self._call(
            prefix,
            lambda: obstore.list(self._store, clean or None, offset=offset, chunk_size=1000),
        )
        lead = f"{clean}/" if clean else ""
        chunks = iter(stream)
        while True:
            chunk = self._call(prefix, lambda: next(chunks, None))
            if chunk is None:
                return
            for meta in chunk:
                path = str(meta["path"])
                if end_before is not None and path >= end_before:
                    return
                if start_after is not None and path <= start_after:
                    continue
                if "/" not in path[len(lead) :]:
                    yield self._info(meta)

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        failures: builtins.list[DeleteFailure] = []
        source = iter(paths)
        while chunk := builtins.list(itertools.islice(source, _DELETE_CHUNK)):
            try:
                obstore.delete(self._store, chunk)
            except _STORE_ERRORS as err:
                # A bulk request reports only its first failure: retry one by one to learn
                # exactly which objects are left, so GC can log and retry only those. (GCS
                # deletes one by one anyway and fails the lot on a missing object.)
                if not isinstance(err, (obx.NotFoundError, FileNotFoundError)):
                    logger.warning(
                        "bulk delete of %s objects failed (%s); deleting one by one",
                        len(chunk),
                        _first_line(err),
                    )
                failures.extend(self._delete_each(chunk))
        return failures

    def _delete_each(self, paths: builtins.list[str]) -> builtins.list[DeleteFailure]:
        def one(path: str) -> DeleteFailure | None:
            try:
                obstore.delete(self._store, path)
            except (obx.NotFoundError, FileNotFoundError):
                return None
            except _STORE_ERRORS as err:
                return DeleteFailure(path=path, reason=_first_line(err))
            return None

        with ThreadPoolExecutor(
            _DELETE_FALLBACK_THREADS, thread_name_prefix="millpond-del"
        ) as pool:
            return [f for f in pool.map(one, paths) if f is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = partial(
            ObstoreStore,
            backend=self._backend,
            credential_source=self._credential_source,
            credential_hint=self._hint,
            credential_parts=self._parts,
        )
        return (rebuild, (self._store, self.url))

    # -- tokens and errors -----------------------------------------------------------------

    def _token(self, meta: Mapping[str, Any]) -> str | None:
        if self._generations:
            version = meta.get("version")
            return None if version is None else str(version)
        etag = meta.get("e_tag")
        return None if etag is None else str(etag)

    def _info(self, meta: Mapping[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            path=str(meta["path"]),
            size=int(meta["size"]),
            last_modified=meta.get("last_modified"),
            etag=self._token(meta),
        )

    def _call(self, path: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except _STORE_ERRORS as err:
            self._translate(path, err)

    def _translate(self, path: str, err: BaseException) -> NoReturn:
        self._refused(path, err)
        # obstore raises the built-in FileNotFoundError for a missing object.
        if isinstance(err, (obx.NotFoundError, FileNotFoundError)):
            raise NotFoundError(f"{path}: not found") from err
        if isinstance(err, (obx.InvalidPathError, obx.UnknownConfigurationKeyError)):
            raise ConfigError("store", f"{path}: {_first_line(err)}") from err
        raise StorageError(f"{self.url}/{path}: {_first_line(err)}") from err

    def _translate_write(self, path: str, err: BaseException) -> NoReturn:
        self._refused(path, err)
        if isinstance(err, obx.NotSupportedError):
            raise StoreAccessError(
                f"{self.url}: conditional writes unsupported: {_first_line(err)}",
                problem="conditional_writes",
                hint="use a store that honours If-None-Match and If-Match",
            ) from err
        # After a failure on the wire the write may have reached the store.
        raise CommitStateUnknownError(f"{path}: write outcome unknown: {_first_line(err)}") from err

    def _refused(self, path: str, err: BaseException) -> None:
        """Raise :class:`StoreAccessError` when ``err`` is a refusal no retry can fix.

        Raises:
            StoreAccessError: credentials missing or rejected, bucket missing, no permission.
        """
        text = str(err)
        where = f"{self.url}/{path}"
        bucket = urlsplit(self.url).netloc or self.url
        noun = "container" if self._backend == "azure" else "bucket"
        if any(code in text for code in _MISSING_BUCKET):
            naming = bucket_name_problem(self.url, strict=True)
            raise StoreAccessError(
                f"{self.url}: {noun} {bucket!r} does not exist",
                problem="bucket",
                hint=f"create the {noun}, or fix the store URL"
                + (f" ({naming})" if naming else ""),
            ) from err
        if isinstance(err, (obx.NotFoundError, FileNotFoundError)):
            return
        if isinstance(err, obx.UnauthenticatedError) or any(
            code in text for code in _BAD_CREDENTIALS
        ):
            self._rejected(where, err)
        if isinstance(err, obx.PermissionDeniedError):
            raise StoreAccessError(
                f"{where}: permission denied for the credentials ({self._credential_source}): "
                f"{_first_line(err)}",
                problem="permission",
                hint=f"allow list, get, put and delete under {self.url}",
            ) from err
        if self._backend and _NO_CREDENTIALS.search(text) and "status code: 5" not in text:
            raise StoreAccessError(
                f"{self.url}: no credentials found (tried {self._credential_source}): "
                f"{_first_line(err)}",
                problem="credentials",
                hint=self._hint,
            ) from err

    def _rejected(self, where: str, err: BaseException) -> NoReturn:
        """The store refused the credentials: which part, where it was set, and its fix.

        Raises:
            StoreAccessError: always, ``problem="credentials"``.
        """
        status, code = _answer(err)
        answered = f"the store answered {status} {code}".rstrip() if status or code else ""
        precise = rejection(code, self._parts) if self._backend == "s3" else None
        if precise is not None:
            what, hint = precise
            message = f"{where}: {what} ({answered})" if answered else f"{where}: {what}"
        else:
            what = f"the store rejected the credentials ({self._credential_source})"
            message = f"{where}: {what}: {answered or _first_line(err)}"
            hint = f"check them ({self._hint})" if self._hint else "check the store's credentials"
        raise StoreAccessError(message, problem="credentials", hint=hint) from err


def _answer(err: BaseException) -> tuple[str, str]:
    """The store's status and error code in an obstore error (``("403",
    "SignatureDoesNotMatch")``), empty where the text has none."""
    text = str(err)
    status = _STATUS.search(text)
    code = _XML_CODE.search(text)
    return (status.group(1) if status else "", code.group(1) if code else "")


_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _named_memory_store(name: str) -> Any:
    """One MemoryStore per name in this process, so a producer and a consumer opened on the
    same ``memory://name`` URL see the same objects."""
    with _MEMORY_LOCK:
        store = _MEMORY_STORES.get(name)
        if store is None:
            store = _MEMORY_STORES[name] = MemoryStore()
        return store


def _first_line(err: BaseException) -> str:
    """The first line of an obstore error; a store's XML error body that starts on it is
    given as its code and message (``403 Forbidden: SignatureDoesNotMatch: The request …``)."""
    whole = str(err).strip()
    text = whole.splitlines()
    line = text[0] if text else type(err).__name__
    prolog = line.rfind("<?xml")
    if prolog >= 0:
        code, message = _XML_CODE.search(whole), _XML_MESSAGE.search(whole)
        said = ": ".join(m.group(1).strip() for m in (code, message) if m is not None)
        line = line[:prolog].rstrip(" :") + (f": {said}" if said else "")
    return _SECRET_PARAMS.sub(lambda m: f"{m.group(1)}=REDACTED", line)
