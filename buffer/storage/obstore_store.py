"""The obstore adapter: the only module that imports obstore.

obstore's exceptions are translated here into the millpond error tree, with ``raise ... from``.
Conditional writes map onto obstore's put modes: ``"create"`` for create-if-absent and
``{"e_tag": ...}`` for update-if-unchanged (S3 needs ``aws_conditional_put="etag"``).
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NoReturn, TypeVar, cast
from urllib.parse import urlsplit

import obstore
from obstore import exceptions as obx
from obstore.store import MemoryStore, S3Store

from millpond.errors import (
    CommitStateUnknownError,
    ConfigError,
    ConflictError,
    NotFoundError,
    StorageError,
)
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
_DEFAULT_CLIENT: dict[str, Any] = {
    "connect_timeout": timedelta(seconds=5),
    "timeout": timedelta(seconds=120),
}
_TRUE = frozenset({"1", "true", "yes", "on"})
_CLIENT_KEYS = frozenset(
    {"connect_timeout", "timeout", "pool_idle_timeout", "pool_max_idle_per_host", "allow_http"}
)


class ObstoreStore(ObjectStore):
    """An :class:`ObjectStore` over any obstore store (S3, memory, ...)."""

    def __init__(self, store: Any, url: str) -> None:
        self._store = store
        self.url = url

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, str] | None = None) -> ObstoreStore:
        """Open ``s3://bucket[/root]`` or ``memory://``.

        Raises:
            ConfigError: an unknown option or a malformed URL.
        """
        parts = urlsplit(url)
        if parts.scheme == "memory":
            return cls(_named_memory_store(parts.netloc + parts.path), url)
        config: dict[str, Any] = {k: v for k, v in (options or {}).items() if k not in _CLIENT_KEYS}
        client: dict[str, Any] = {
            **_DEFAULT_CLIENT,
            **{k: v for k, v in (options or {}).items() if k in _CLIENT_KEYS},
        }
        # Conditional updates on S3 are ETag based; without this obstore refuses them.
        config.setdefault("aws_conditional_put", "etag")
        # AWS_ALLOW_HTTP maps to a client option: obstore 0.12 parses ``aws_allow_http`` as an
        # S3 config key but then panics ("Expected config prefix to start with aws_").
        allow_http = config.pop("aws_allow_http", None)
        if allow_http is not None:
            client.setdefault("allow_http", str(allow_http).strip().lower() in _TRUE)
        if config.get("aws_endpoint", "").startswith("http://"):
            client.setdefault("allow_http", True)
        try:
            # obstore types these as TypedDicts; ours are validated by obstore itself.
            store = S3Store.from_url(
                url,
                config=cast("Any", config),
                client_options=cast("Any", client),
                retry_config=cast("Any", _DEFAULT_RETRY),
            )
        except obx.BaseError as err:
            raise ConfigError("store", f"cannot open {url!r}: {_first_line(err)}") from err
        except (ValueError, TypeError) as err:
            raise ConfigError("store_options", f"cannot open {url!r}: {err}") from err
        return cls(store, f"{parts.scheme}://{parts.netloc}{parts.path}")

    @classmethod
    def wrap(cls, store: Any) -> ObstoreStore:
        """Adopt an obstore store object the caller built."""
        if not hasattr(store, "put") or not hasattr(store, "get"):
            raise ConfigError(
                "store", f"expected a URL or an obstore store, found {type(store).__name__}"
            )
        prefix = getattr(store, "prefix", None)
        return cls(store, f"{type(store).__name__}({prefix or ''})")

    def get(self, path: str) -> GetResult:
        result = _call(path, lambda: obstore.get(self._store, path))
        data = _call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=result.meta.get("e_tag"))

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        if etag is None:
            return self.get(path)
        try:
            result = obstore.get(self._store, path, options={"if_none_match": etag})
        except obx.NotModifiedError:
            return None
        except _STORE_ERRORS as err:
            _translate(path, err)
        data = _call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=result.meta.get("e_tag"))

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        options: dict[str, Any] = {"range": {"suffix": length}}
        if etag is not None:
            options["if_none_match"] = etag
        try:
            result = obstore.get(self._store, path, options=cast("Any", options))
        except obx.NotModifiedError:
            return None
        except _STORE_ERRORS as err:
            _translate(path, err)
        data = _call(path, lambda: bytes(result.bytes()))
        return GetResult(data=data, etag=result.meta.get("e_tag"))

    def head(self, path: str) -> ObjectInfo:
        meta = _call(path, lambda: obstore.head(self._store, path))
        return _info(meta)

    def put(self, path: str, data: bytes) -> str | None:
        result = _call(path, lambda: obstore.put(self._store, path, data, use_multipart=False))
        return result.get("e_tag")

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        try:
            result = obstore.put(self._store, path, data, mode="create", use_multipart=False)
        except obx.AlreadyExistsError as err:
            raise ConflictError(f"{path}: already exists") from err
        except obx.PreconditionError as err:
            raise ConflictError(f"{path}: already exists") from err
        except _STORE_ERRORS as err:
            _translate_write(path, err)
        return result.get("e_tag")

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        try:
            result = obstore.put(self._store, path, data, mode={"e_tag": etag}, use_multipart=False)
        except (
            obx.PreconditionError,
            obx.NotFoundError,
            obx.AlreadyExistsError,
            FileNotFoundError,
        ) as err:
            raise ConflictError(f"{path}: changed since ETag {etag} was read") from err
        except _STORE_ERRORS as err:
            _translate_write(path, err)
        return result.get("e_tag")

    def copy(self, source: str, target: str) -> None:
        _call(source, lambda: obstore.copy(self._store, source, target, overwrite=True))

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        clean = prefix.strip("/") or None
        if recursive:
            chunks = _call(prefix, lambda: list(obstore.list(self._store, clean, chunk_size=1000)))
            return [_info(meta) for chunk in chunks for meta in chunk]
        listing = _call(prefix, lambda: obstore.list_with_delimiter(self._store, clean))
        return [_info(meta) for meta in listing["objects"]]

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        failures: builtins.list[DeleteFailure] = []
        for chunk in _chunks(paths, _DELETE_CHUNK):
            try:
                obstore.delete(self._store, chunk)
            except _STORE_ERRORS as err:
                # A bulk request reports only its first failure: retry one by one to learn
                # exactly which objects are left, so GC can log and retry only those.
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
        return (ObstoreStore, (self._store, self.url))


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


def _call(path: str, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except _STORE_ERRORS as err:
        _translate(path, err)


def _translate(path: str, err: BaseException) -> NoReturn:
    # obstore raises the built-in FileNotFoundError for a missing object.
    if isinstance(err, (obx.NotFoundError, FileNotFoundError)):
        raise NotFoundError(f"{path}: not found") from err
    if isinstance(err, (obx.InvalidPathError, obx.UnknownConfigurationKeyError)):
        raise ConfigError("store", f"{path}: {_first_line(err)}") from err
    raise StorageError(f"{path}: {_first_line(err)}") from err


def _translate_write(path: str, err: BaseException) -> NoReturn:
    if isinstance(err, obx.NotSupportedError):
        raise ConfigError(
            "store", f"{path}: conditional writes unsupported: {_first_line(err)}"
        ) from err
    # After a failure on the wire the write may have reached the store.
    raise CommitStateUnknownError(f"{path}: write outcome unknown: {_first_line(err)}") from err


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        path=str(meta["path"]),
        size=int(meta["size"]),
        last_modified=meta.get("last_modified"),
        etag=meta.get("e_tag"),
    )


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
