"""What a database sink promises, and the errors it raises.

Exactly-once delivery (RFC, "Delivery guarantees") rests on one rule: a sink writes a batch's
rows, its sequence and its location in one transaction. On restart the consumer resumes after
:meth:`Sink.last_sequence`; a batch whose location is already recorded is skipped, so a batch
that a recovering producer enqueued twice lands once. Progress belongs to one queue: a sink
holding another queue's refuses to resume (or write) for this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from millpond.errors import ConfigError, MillpondError

if TYPE_CHECKING:
    from millpond.consumer._batch import ConsumedBatch

__all__ = ["EntryFormat", "Sink", "SinkError"]


class SinkError(MillpondError):
    """The database refused or failed a write.

    ``transient`` separates a database that is down, busy or restarting (retry the same batch
    later: the write is one transaction, so a retry can never double it) from one that will
    never take this batch (stop and fix).
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class EntryFormat(StrEnum):
    """How a sink reads the entries of a batch."""

    AUTO = "auto"
    """Per batch: Arrow when every entry is an Arrow IPC stream, opaque when none is."""
    ARROW = "arrow"
    """Every entry is an Arrow IPC stream (``produce_arrow``); rows keep their columns."""
    OPAQUE = "opaque"
    """Entries are opaque bytes: one row per entry with its sequence, index and metadata."""

    @classmethod
    def parse(cls, value: str | EntryFormat) -> EntryFormat:
        """Accept a member or its name.

        Raises:
            ConfigError: any other value.
        """
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                "entry_format", f"expected 'auto', 'arrow' or 'opaque', found {value!r}"
            ) from None


@runtime_checkable
class Sink(Protocol):
    """A database table that batches are written into exactly once."""

    @property
    def rows_written(self) -> int:
        """Rows committed by this sink object since it was opened."""
        ...

    def last_sequence(self, queue: str) -> int | None:
        """The highest sequence of ``queue`` recorded, or ``None`` when nothing ever was.

        Args:
            queue: the identity of the queue being consumed (``Consumer.queue``).

        Raises:
            SinkError: the sink holds another queue's progress (permanent, naming both), or
                the database failed.
        """
        ...

    def write(self, batch: ConsumedBatch) -> bool:
        """Write the batch's rows with its sequence and location in one transaction.

        Returns:
            ``True`` when the rows were written, ``False`` when the batch was skipped because
            its sequence or its location is already recorded.

        Raises:
            FormatError: the entries cannot be read as rows.
            SinkError: the database failed (nothing of this batch was committed).
        """
        ...

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        """Write batches in sequence order in one transaction, all or nothing.

        Returns:
            Per batch, what :meth:`write` would have returned.

        Raises:
            FormatError: a batch cannot be read as rows or the batches' schemas clash.
            SinkError: the database failed (nothing committed).
        """
        ...

    def close(self) -> None:
        """Close the connection. Idempotent."""
        ...
