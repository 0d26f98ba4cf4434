"""The queue manifest protocol on object storage (OpenData RFC 0001): the roles' front door.

Producers, consumers and collectors import the protocol from here, never from its inner
modules (an import-linter contract says so): :class:`Queue` opens one queue and hands each role
its side — the writer (append with compare-and-swap, group commit, in-doubt resolution), the
reader (fenced reads and dequeues), the takeover, a collection pass — and the names below are
what the roles use of the protocol's records (claim, backlog index, holds, epoch mark) and
observations. The inner modules:

* :mod:`~millpond.queue.location` — where a queue lives, the base of every role's config;
* :mod:`~millpond.queue.front_door` — :class:`Queue`;
* :mod:`~millpond.queue.cas` — compare-and-swap on the manifest, shared by both sides;
* :mod:`~millpond.queue.append`, :mod:`~millpond.queue.peek`, :mod:`~millpond.queue.landed` —
  the writer, the read it sends alongside a contended write, what an ambiguous write left;
* :mod:`~millpond.queue.dequeue`, :mod:`~millpond.queue.takeover` — the reader, its takeover;
* :mod:`~millpond.queue.claim`, :mod:`~millpond.queue.epoch_mark`, :mod:`~millpond.queue.index`,
  :mod:`~millpond.queue.holds` — the queue's records beside the manifest;
* :mod:`~millpond.queue.gc_rules`, :mod:`~millpond.queue.observe` — what GC may delete; looking at
  a queue without changing it;
* :mod:`~millpond.queue.written`, :mod:`~millpond.queue.sink_wait` — what the consumer service
  has written into its database, and waiting for it.
"""

from __future__ import annotations

from millpond.queue.append import QueueProducer
from millpond.queue.cas import Appender, ManifestSnapshot, read_manifest
from millpond.queue.claim import (
    CLOCK_PROBE,
    MAX_CLOCK_SKEW,
    QueueClaim,
    internal_path,
    open_claim,
    queue_identity,
    same_queue,
)
from millpond.queue.cursor import QueueCursor
from millpond.queue.dequeue import QueueConsumer
from millpond.queue.epoch_mark import is_replaced, read_epoch_mark
from millpond.queue.fenced import FencedObject, Version
from millpond.queue.front_door import Queue
from millpond.queue.gc_rules import GcPlan, GcReport, KeepReason, collect_once, plan_collection
from millpond.queue.holds import encode_hold, hold_path, locations_of
from millpond.queue.index import (
    BacklogIndex,
    IndexHead,
    decode_head,
    head_path,
    queue_view,
    read_indexed,
)
from millpond.queue.landed import Landing, Landings, LandingStatus
from millpond.queue.location import QueueLocation
from millpond.queue.observe import (
    EntryReader,
    QueueLook,
    batch_time_ms,
    bytes_from,
    entry_time_ms,
    look_at_queue,
    look_with_entry,
    referenced_bytes,
)
from millpond.queue.sink_wait import DEFAULT_POLL_INTERVAL, SinkLook, SinkWatch
from millpond.queue.takeover import Takeover, take_over_queue
from millpond.queue.written import (
    SetAsideMark,
    WrittenMark,
    note_set_aside,
    read_written,
    written_object,
    written_path,
)

__all__ = [
    "CLOCK_PROBE",
    "DEFAULT_POLL_INTERVAL",
    "MAX_CLOCK_SKEW",
    "Appender",
    "BacklogIndex",
    "EntryReader",
    "FencedObject",
    "GcPlan",
    "GcReport",
    "IndexHead",
    "KeepReason",
    "Landing",
    "LandingStatus",
    "Landings",
    "ManifestSnapshot",
    "Queue",
    "QueueClaim",
    "QueueConsumer",
    "QueueCursor",
    "QueueLocation",
    "QueueLook",
    "QueueProducer",
    "SetAsideMark",
    "SinkLook",
    "SinkWatch",
    "Takeover",
    "Version",
    "WrittenMark",
    "batch_time_ms",
    "bytes_from",
    "collect_once",
    "decode_head",
    "encode_hold",
    "entry_time_ms",
    "head_path",
    "hold_path",
    "internal_path",
    "is_replaced",
    "locations_of",
    "look_at_queue",
    "look_with_entry",
    "note_set_aside",
    "open_claim",
    "plan_collection",
    "queue_identity",
    "queue_view",
    "read_epoch_mark",
    "read_indexed",
    "read_manifest",
    "read_written",
    "referenced_bytes",
    "same_queue",
    "take_over_queue",
    "written_object",
    "written_path",
]
