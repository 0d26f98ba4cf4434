"""The millpond producer: a local write-ahead log in front of batch uploads and the queue.

``Producer(ProducerConfig(store=..., wal_dir=...))`` stages every ``produce()`` call in a
CRC-framed local WAL (fsynced with group commit), flushes staged calls as RFC v1 batch objects
named by ULID, appends their locations to the queue manifest with one compare-and-swap per
group, and releases the WAL region only once both landed. A restarted producer replays its WAL
and publishes what was left, without enqueueing anything twice.
"""

from __future__ import annotations

from millpond.producer._state import CloseReport
from millpond.producer.config import ProducerConfig
from millpond.producer.handle import WriteHandle
from millpond.producer.producer import Producer
from millpond.wal import LostRegion, RecoveryReport

__all__ = [
    "CloseReport",
    "LostRegion",
    "Producer",
    "ProducerConfig",
    "RecoveryReport",
    "WriteHandle",
]
