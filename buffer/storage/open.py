"""A store from a URL: :func:`open_store` picks the implementation.

Apart from :mod:`millpond.storage.store` because the implementations import the interface
there (an ``open_store`` beside it made the three modules one import cycle). The
implementations are imported when a store is opened, so importing millpond loads no obstore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from millpond.storage.store import ObjectStore, check_store_url

__all__ = ["open_store"]


def open_store(
    store: str | ObjectStore | Any, options: Mapping[str, str] | None = None
) -> ObjectStore:
    """An :class:`ObjectStore` from a URL, an existing store, or an obstore store object.

    URLs: ``s3://bucket[/root]``, ``az://container[/root]``, ``gs://bucket[/root]``,
    ``file:///path``, ``memory://[name]`` (one store per name in the process). Options not
    given in ``options`` come from each backend's standard variables (``AWS_*``,
    ``AZURE_STORAGE_*``, ``GOOGLE_*``). Opening sends no request.

    Raises:
        ConfigError: an unsupported URL scheme or a bad option.
    """
    if isinstance(store, ObjectStore):
        return store
    if isinstance(store, str):
        check_store_url(store)
        if urlsplit(store).scheme == "file":
            from millpond.storage.file_store import FileStore

            return FileStore.from_url(store)
        from millpond.storage.obstore_store import ObstoreStore

        return ObstoreStore.from_url(store, options)
    from millpond.storage.obstore_store import ObstoreStore

    return ObstoreStore.wrap(store)
