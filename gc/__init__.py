"""Garbage collection: delete batch objects that nothing references any more.

```python
from millpond.gc import GarbageCollector, GarbageCollectorConfig

report = GarbageCollector(GarbageCollectorConfig(store="s3://bucket")).run_once()
print(report.deleted, report.kept, report.failures)
```

The rules are the RFC's and live in the core (:mod:`millpond.queue.gc_rules`), because the consumer
runs the same pass in its own process; this package is the stand-alone collector and its
scheduled-job entry point, ``millpond gc``.
"""

from __future__ import annotations

from millpond.gc._collector import GarbageCollector, GarbageCollectorConfig
from millpond.queue import GcPlan, GcReport, KeepReason, plan_collection

__all__ = [
    "GarbageCollector",
    "GarbageCollectorConfig",
    "GcPlan",
    "GcReport",
    "KeepReason",
    "plan_collection",
]
