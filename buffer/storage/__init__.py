"""Object storage: the :class:`ObjectStore` interface millpond needs and its implementations.

* :mod:`millpond.storage.store` — the interface and :class:`ForwardingStore` for wrappers;
* :mod:`millpond.storage.open` — :func:`open_store` (a store from a URL);
* :mod:`millpond.storage.obstore_store` — S3, Azure Blob, GCS and memory through obstore, the
  only module that imports obstore;
* :mod:`millpond.storage.file_store` — a local directory with a compare-and-swap of its own;
* :mod:`millpond.storage.checks` — what ``millpond doctor`` checks, and the cheap part every
  role runs at start (:func:`~millpond.storage.checks.preflight`).
"""

from __future__ import annotations

from millpond.storage.open import open_store
from millpond.storage.store import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
)

__all__ = [
    "DeleteFailure",
    "ForwardingStore",
    "GetResult",
    "ObjectInfo",
    "ObjectStore",
    "open_store",
]
