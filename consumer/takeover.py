"""Taking over a queue where the sink left off, when an older consumer may still be running.

A consumer starts after the sink's last sequence. That progress is read before the takeover,
so that a sink holding another queue's progress is refused before any consumer is fenced. An
older consumer still running (a rolling restart, one taken for dead) may meanwhile write more
into the sink and dequeue it: the queue then starts past the progress read, and
``initialize()`` refuses it (:class:`~millpond.errors.ProgressBehindError`). The takeover
fenced that consumer first, and a consumer acks only what its sink has written, so the
progress read again holds every entry it dequeued: :func:`take_over` reads it once more and
takes over from there.

```python
take_over(consumer, lambda: sink.last_sequence(consumer.queue))
```
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import EllipsisType
from typing import TYPE_CHECKING

from millpond.errors import ProgressBehindError

if TYPE_CHECKING:
    from millpond.consumer._consumer import Consumer

__all__ = ["take_over"]

logger = logging.getLogger(__name__)


def take_over(
    consumer: Consumer,
    progress: Callable[[], int | None],
    *,
    read: int | EllipsisType | None = ...,
) -> int | None:
    """``consumer.initialize()`` after the sink's last sequence; returns the sequence used.

    Args:
        consumer: the consumer taking over.
        progress: reads the sink's last sequence for this queue (``None``: nothing written).
        read: what ``progress()`` returned just before, when the caller read it already (the
            service does, to refuse a wrong sink before its retries start).

    Raises:
        ProgressBehindError: read again after the takeover, the progress still trails the
            queue: entries were dequeued that this sink never recorded.
        everything ``Consumer.initialize`` raises.
    """
    start = progress() if read is ... else read
    try:
        consumer.initialize(last_acked_sequence=start)
    except ProgressBehindError as err:
        again = progress()
        if again == start:
            raise
        logger.info(
            "%s: the sink's progress (%s) trailed the queue (first entry %s) when read before "
            "the takeover, as while an older consumer was still writing; read again: %s",
            consumer.config.manifest_path,
            start,
            err.first,
            again,
        )
        start = again
        consumer.initialize(last_acked_sequence=start)
    return start
