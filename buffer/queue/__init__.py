"""The queue manifest protocol on object storage (OpenData RFC 0001).

* :mod:`millpond.queue.cas` — the queue producer (append with compare-and-swap, group commit)
  and the queue consumer (epoch fencing, dequeue);
* :mod:`millpond.queue.gc_rules` — which batch objects garbage collection may delete, shared by
  the stand-alone collector and the consumer's own.
"""

from __future__ import annotations

from millpond.queue.cas import ManifestSnapshot, QueueConsumer, QueueProducer, read_manifest

__all__ = ["ManifestSnapshot", "QueueConsumer", "QueueProducer", "read_manifest"]
