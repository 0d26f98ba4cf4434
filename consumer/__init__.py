"""The consumer: reads the queue in order under epoch fencing and hands out batches.

```python
from millpond.consumer import Consumer, ConsumerConfig

with Consumer(ConsumerConfig(store="s3://bucket")) as consumer:
    consumer.initialize(last_acked_sequence=sink.last_sequence(consumer.queue))
    while (batch := consumer.next_batch()) is not None:
        sink.write(batch)                 # rows + sequence + location in one transaction
        consumer.ack(batch.sequence)
```

Database sinks that make this exactly-once live in :mod:`millpond.consumer.sinks`; the
long-running service is ``millpond consume`` (:mod:`millpond.consumer.service`).
"""

from __future__ import annotations

from millpond.consumer._batch import ConsumedBatch
from millpond.consumer._config import ConsumerConfig
from millpond.consumer._consumer import Backlog, Consumer
from millpond.formats.manifest import Metadata

__all__ = ["Backlog", "ConsumedBatch", "Consumer", "ConsumerConfig", "Metadata"]
