"""Millpond: a stateless ingest buffer on object storage (OpenData RFC 0001).

Producers stage records in a local write-ahead log, flush them as ULID-named batch objects and
append their locations to one queue manifest with compare-and-swap; one epoch-fenced consumer
writes each batch into a database exactly once; a garbage collector removes batch objects that
nothing references.

The producer, consumer and collector are imported lazily, so ``import millpond`` stays cheap
and the core never imports them at module level.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from millpond.errors import (
    BackpressureError,
    BadBatchError,
    BatchNotFoundError,
    ClosedError,
    CommitStateUnknownError,
    ConfigError,
    ConflictError,
    CorruptBatchError,
    FencedError,
    FormatError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
    SinkWaitError,
    SinkWaitTimeoutError,
    StorageError,
    StoreAccessError,
)
from millpond.formats.batch import CompressionType
from millpond.formats.manifest import Metadata
from millpond.storage import ObjectStore, open_store

if TYPE_CHECKING:
    from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
    from millpond.gc import GarbageCollector, GarbageCollectorConfig
    from millpond.producer import Producer, ProducerConfig, WriteHandle

__all__ = [
    "BackpressureError",
    "BadBatchError",
    "BatchNotFoundError",
    "ClosedError",
    "CommitStateUnknownError",
    "CompressionType",
    "ConfigError",
    "ConflictError",
    "ConsumedBatch",
    "Consumer",
    "ConsumerConfig",
    "CorruptBatchError",
    "FencedError",
    "FormatError",
    "GarbageCollector",
    "GarbageCollectorConfig",
    "InvalidInputError",
    "Metadata",
    "MillpondError",
    "NotFoundError",
    "ObjectStore",
    "Producer",
    "ProducerConfig",
    "SinkWaitError",
    "SinkWaitTimeoutError",
    "StorageError",
    "StoreAccessError",
    "WriteHandle",
    "open_store",
]

_LAZY = {
    "Producer": "millpond.producer",
    "ProducerConfig": "millpond.producer",
    "WriteHandle": "millpond.producer",
    "Consumer": "millpond.consumer",
    "ConsumerConfig": "millpond.consumer",
    "ConsumedBatch": "millpond.consumer",
    "GarbageCollector": "millpond.gc",
    "GarbageCollectorConfig": "millpond.gc",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'millpond' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
