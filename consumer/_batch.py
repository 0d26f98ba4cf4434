"""``ConsumedBatch``: one batch object's entries with its sequence, location and metadata."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from millpond.errors import FormatError
from millpond.formats.arrow import decode_ipc, unify_tables
from millpond.formats.manifest import Metadata

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ConsumedBatch"]


@dataclass(frozen=True, slots=True)
class ConsumedBatch:
    """A batch as the consumer delivers it (RFC ``ConsumedBatch``)."""

    entries: tuple[bytes, ...]
    """The records of the batch object, in order."""
    sequence: int
    """The manifest sequence number; ack it once the batch is processed."""
    location: str
    """Path of the batch object in the store, ``{data_path_prefix}/{ULID}.batch``."""
    metadata: tuple[Metadata, ...] = ()
    """Per-range metadata items: item ``i`` covers entries from its ``start_index`` up to the
    next item's (or the end)."""
    queue: str = ""
    """The identity of the queue it came from (store URL and manifest path, see
    :func:`millpond.queue.claim.queue_identity`): what a sink keys its progress by."""

    def metadata_for(self, index: int) -> Metadata | None:
        """The metadata item covering entry ``index``, or ``None`` when none does."""
        starts = [item.start_index for item in self.metadata]
        at = bisect.bisect_right(starts, index) - 1
        return self.metadata[at] if at >= 0 else None

    def to_arrow(self) -> pa.Table:
        """The entries as one Arrow table; each entry must be an Arrow IPC stream.

        Schemas that drifted between entries are unified: the superset of columns, each at
        the widest type seen, with nulls where an entry lacked a column.

        Raises:
            FormatError: an entry is not an Arrow IPC stream, or two schemas cannot be
                reconciled; the message names the batch location and entry.
        """
        tables = [
            decode_ipc(entry, name=f"{self.location} (sequence {self.sequence}) entry {index}")
            for index, entry in enumerate(self.entries)
        ]
        if len(tables) == 1:
            return tables[0]
        try:
            return unify_tables(tables)
        except FormatError as err:
            raise FormatError(
                f"{self.location} (sequence {self.sequence}): {err}", field=err.field
            ) from err
