"""From a consumed batch to one Arrow table of rows. Pure: no database, no IO."""

from __future__ import annotations

import itertools

import pyarrow as pa

from millpond.consumer._batch import ConsumedBatch
from millpond.consumer.sinks.base import EntryFormat
from millpond.errors import FormatError

__all__ = ["OPAQUE_SCHEMA", "batch_rows", "detect_format"]

# Every Arrow IPC stream message starts with the continuation marker (format >= 0.15).
_IPC_MARKER = b"\xff\xff\xff\xff"

OPAQUE_SCHEMA = pa.schema(
    [
        pa.field("sequence", pa.int64(), nullable=False),
        pa.field("entry_index", pa.int32(), nullable=False),
        pa.field("payload", pa.binary(), nullable=False),
        pa.field("ingestion_time_ms", pa.int64()),
        pa.field("metadata", pa.binary()),
    ]
)


def detect_format(batch: ConsumedBatch) -> EntryFormat:
    """Arrow when every entry starts like an IPC stream, opaque when none does.

    Raises:
        FormatError: the batch mixes both kinds; choose ``arrow`` or ``opaque`` explicitly.
    """
    arrow = sum(1 for entry in batch.entries if entry[:4] == _IPC_MARKER)
    if arrow == 0:
        return EntryFormat.OPAQUE
    if arrow == len(batch.entries):
        return EntryFormat.ARROW
    raise FormatError(
        f"{batch.location} (sequence {batch.sequence}): {arrow} of {len(batch.entries)} "
        "entries look like Arrow IPC streams, the rest do not; set the entry format to "
        "'arrow' or 'opaque'",
        field="entry",
    )


def batch_rows(
    batch: ConsumedBatch, entry_format: EntryFormat, *, sequence_column: str | None
) -> pa.Table:
    """The rows a batch becomes.

    Arrow entries keep their columns (drifted schemas unified), plus ``sequence_column``
    holding the batch sequence when it is set. Opaque entries become :data:`OPAQUE_SCHEMA`
    rows, one per entry, with the metadata item that covers the entry.

    Raises:
        FormatError: an entry is not what ``entry_format`` says, or Arrow schemas clash.
    """
    if not batch.entries:
        return OPAQUE_SCHEMA.empty_table()
    if entry_format is EntryFormat.AUTO:
        entry_format = detect_format(batch)
    if entry_format is EntryFormat.OPAQUE:
        return _opaque_rows(batch)
    table = batch.to_arrow()
    if sequence_column is not None:
        if sequence_column in table.column_names:
            raise FormatError(
                f"{batch.location} (sequence {batch.sequence}): the rows already have a "
                f"column {sequence_column!r}; choose another sequence column",
                field="schema",
            )
        table = table.append_column(
            pa.field(sequence_column, pa.int64(), nullable=False),
            pa.repeat(pa.scalar(batch.sequence, pa.int64()), table.num_rows),
        )
    return table


def _opaque_rows(batch: ConsumedBatch) -> pa.Table:
    count = len(batch.entries)
    times: list[pa.Array] = []
    payloads: list[pa.Array] = []
    # Metadata item i covers entries [start_i, start_{i+1}); entries before the first item,
    # if a producer ever wrote such a batch, get nulls.
    bounds = [min(item.start_index, count) for item in batch.metadata] + [count]
    if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
        raise FormatError(
            f"{batch.location} (sequence {batch.sequence}): metadata start_index values "
            f"{[item.start_index for item in batch.metadata]} are not in order",
            field="start_index",
        )
    if not batch.metadata or bounds[0] > 0:
        head = bounds[0] if batch.metadata else count
        times.append(pa.nulls(head, pa.int64()))
        payloads.append(pa.nulls(head, pa.binary()))
    for item, (start, end) in zip(batch.metadata, itertools.pairwise(bounds), strict=False):
        times.append(pa.repeat(pa.scalar(item.ingestion_time_ms, pa.int64()), end - start))
        payloads.append(pa.repeat(pa.scalar(item.payload, pa.binary()), end - start))
    return pa.Table.from_arrays(
        [
            pa.repeat(pa.scalar(batch.sequence, pa.int64()), count),
            pa.array(range(count), pa.int32()),
            pa.array(batch.entries, pa.binary()),
            pa.concat_arrays(times),
            pa.concat_arrays(payloads),
        ],
        schema=OPAQUE_SCHEMA,
    )
