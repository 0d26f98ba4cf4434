"""The consumer: reads the queue in order under epoch fencing and hands out batches.

```python
from millpond.consumer import Consumer, ConsumerConfig
from millpond.consumer.takeover import take_over

with Consumer(ConsumerConfig(store="s3://bucket")) as consumer:
    take_over(consumer, lambda: sink.last_sequence(consumer.queue))  # initialize() after it
    while (batch := consumer.next_batch()) is not None:
        sink.write(batch)                 # rows + sequence + location in one transaction
        consumer.ack(batch.sequence)
```

Database sinks that make this exactly-once live in :mod:`millpond.consumer.sinks`. This package
is the library; the operator application built on it, which it never imports, is
:mod:`millpond.consumer.app`: the long-running service ``millpond consume``
(:mod:`millpond.consumer.app.service`), ``millpond status``, ``doctor``, ``quarantine`` and
``replay``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from millpond.formats.manifest import Metadata

if TYPE_CHECKING:
    from millpond.consumer._batch import ConsumedBatch
    from millpond.consumer._config import ConsumerConfig
    from millpond.consumer._consumer import Backlog, Consumer

__all__ = ["Backlog", "ConsumedBatch", "Consumer", "ConsumerConfig", "Metadata"]

# Imported on first use: the commands that only look at a queue (``millpond status``) must
# not pay for pyarrow, which ``ConsumedBatch`` brings (half a second on a busy machine).
_LAZY = {
    "Backlog": "millpond.consumer._consumer",
    "Consumer": "millpond.consumer._consumer",
    "ConsumedBatch": "millpond.consumer._batch",
    "ConsumerConfig": "millpond.consumer._config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
