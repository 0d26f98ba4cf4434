"""``QueueLocation``: where a queue lives in a store, the settings every role's config shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from millpond.errors import ConfigError
from millpond.storage import ObjectStore, open_store
from millpond.storage.store import check_store_url

__all__ = ["QueueLocation"]

_MAX_PATH_BYTES = 0xFFFF - 40
"""Room for ``/``, a 26-character ULID and ``.batch`` in a manifest location (u16 length)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueLocation:
    """Where a queue lives: its store, the store's options, its manifest and its data prefix.

    ``ProducerConfig``, ``ConsumerConfig``, ``GarbageCollectorConfig`` and Spark's
    ``SparkWriteSettings`` inherit these fields and their checks (a ``ConfigError`` naming the
    bad key). Inheritance, not composition: a base field is a keyword of the subclass, so
    ``ProducerConfig(store="s3://b", wal_dir=..., manifest_path=...)`` and
    ``config.manifest_path`` stay as they were; a ``location`` field would be another keyword,
    which properties cannot give back. A subclass's ``__post_init__`` calls
    ``QueueLocation.__post_init__(self)`` first (zero-argument ``super()`` fails in a slotted
    dataclass). Keyword-only, so a subclass's required fields may follow these defaults.
    """

    store: str | ObjectStore | Any
    """Where batches and the manifest live: ``s3://bucket[/root]``, ``az://container[/root]``,
    ``gs://bucket[/root]``, ``file:///path``, ``memory://`` (one process only), a millpond
    :class:`~millpond.storage.store.ObjectStore` or an obstore store object. Required."""
    store_options: Mapping[str, str] = field(default_factory=dict, repr=False)
    """obstore options for a URL ``store`` (S3 ``aws_endpoint``, ``aws_access_key_id``, ...;
    Azure ``azure_storage_account_key``, ...; GCS ``google_service_account``, ...); each
    backend's standard variables (``AWS_*``, ``AZURE_STORAGE_*``, ``GOOGLE_*``) fill in what is
    missing. Default none (``None`` is taken as none). Never logged."""
    manifest_path: str = "ingest/manifest"
    """Path of the queue manifest inside the store. Default ``"ingest/manifest"``."""
    data_path_prefix: str = "ingest"
    """Prefix the batch objects live directly under, as ``{prefix}/{ULID}.batch``; a consumer
    refuses a manifest entry pointing anywhere else. Default ``"ingest"``."""

    def __post_init__(self) -> None:
        _check_store(self.store)
        if self.store_options is None:
            object.__setattr__(self, "store_options", {})
        if not isinstance(self.store_options, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.store_options.items()
        ):
            raise ConfigError("store_options", "expected a mapping of str to str")
        _check_path("data_path_prefix", self.data_path_prefix, folder=True)
        _check_path("manifest_path", self.manifest_path, folder=False)

    def open_store(self) -> ObjectStore:
        """The store these settings point at; opening sends no request.

        Raises:
            ConfigError: a bad option.
        """
        return open_store(self.store, self.store_options)


def _check_store(store: object) -> None:
    if store is None or store == "":
        raise ConfigError("store", f"expected a store URL or object, found {store!r}")
    if isinstance(store, str):
        check_store_url(store)
    elif not (hasattr(store, "put") and hasattr(store, "get")):  # an ObjectStore has both
        raise ConfigError(
            "store",
            f"expected a URL, an ObjectStore or an obstore store, found {type(store).__name__}",
        )


def _check_path(key: str, value: object, *, folder: bool) -> None:
    """A folder may be empty (the store's root); an object path names an object."""
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a str, found {type(value).__name__}")
    clean = value.strip("/")
    if not folder and not clean:
        raise ConfigError(key, f"expected a non-empty object path, found {value!r}")
    if not folder and value.endswith("/"):
        raise ConfigError(key, f"expected an object path, found a folder {value!r}")
    if clean and any(part in ("", ".", "..") for part in clean.split("/")):
        raise ConfigError(key, f"expected a relative object path, found {value!r}")
    if len(clean.encode("utf-8")) > _MAX_PATH_BYTES:
        raise ConfigError(key, f"expected at most {_MAX_PATH_BYTES} bytes, found {len(clean)}")
