"""The queue manifest protocol on object storage (OpenData RFC 0001).

* :mod:`millpond.queue.cas` — compare-and-swap on the manifest, shared by both sides;
* :mod:`millpond.queue.append` — the queue producer (append with compare-and-swap, group commit);
* :mod:`millpond.queue.dequeue` — the queue consumer (epoch fencing, dequeue);
* :mod:`millpond.queue.gc_rules` — which batch objects garbage collection may delete, shared by
  the stand-alone collector and the consumer's own.
"""

from __future__ import annotations

from millpond.queue.append import QueueProducer
from millpond.queue.cas import ManifestSnapshot, read_manifest
from millpond.queue.dequeue import QueueConsumer

__all__ = ["ManifestSnapshot", "QueueConsumer", "QueueProducer", "read_manifest"]
