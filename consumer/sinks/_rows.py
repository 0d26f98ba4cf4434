"""From a consumed batch to Arrow tables of rows, by the table each part names. Pure: no
database, no IO."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pyarrow as pa

from millpond.consumer._batch import ConsumedBatch
from millpond.consumer.sinks.base import EntryFormat
from millpond.errors import FormatError
from millpond.formats.manifest import Metadata
from millpond.formats.routing import split_table

__all__ = ["OPAQUE_SCHEMA", "RoutedRows", "batch_parts", "batch_rows", "detect_format"]

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
    return _rows(batch, entry_format, sequence_column=sequence_column, offset=0)


@dataclass(frozen=True, slots=True)
class RoutedRows:
    """The rows of consecutive entries of a batch whose metadata items name one table."""

    table: str | None
    """The table as the items name it (``millpond.table=``), or ``None``: the sink's own."""
    rows: pa.Table


def batch_parts(
    batch: ConsumedBatch, entry_format: EntryFormat, *, sequence_column: str | None
) -> list[RoutedRows]:
    """The rows a batch becomes, one part per metadata item, each naming its table.

    A metadata item is one ``produce()`` call: its rows are one write, whatever other calls
    share its batch (an upsert's columns are per write). A batch of opaque entries, or of one
    item, naming no table is one part of :func:`batch_rows`. Otherwise every item with entries
    is a part: its entries' rows (the entry format decided for the whole batch when no item
    names a table, per part when some do), and for opaque entries the item's payload without
    its ``millpond.table`` line.

    Raises:
        FormatError: an item's ``millpond.table`` line is bad (:func:`split_table`), items
            out of order, or as :func:`batch_rows`.
    """
    where = f"{batch.location} (sequence {batch.sequence})"
    named = [split_table(item.payload, name=f"{where} metadata") for item in batch.metadata]
    if all(table is None for table, _ in named):
        if entry_format is EntryFormat.AUTO and batch.entries:
            entry_format = detect_format(batch)  # one kind for the whole batch, as before
        if entry_format is not EntryFormat.ARROW or len(batch.metadata) < 2:
            return [
                RoutedRows(None, batch_rows(batch, entry_format, sequence_column=sequence_column))
            ]
    bounds = _bounds(batch)
    parts: list[RoutedRows] = []
    if bounds[0] > 0:  # entries before the first item (no writer makes them): the sink's own
        parts.append(_part(batch, None, 0, bounds[0], None, entry_format, sequence_column))
    for (table, rest), item, start, end in zip(
        named, batch.metadata, bounds, bounds[1:], strict=False
    ):
        if start < end:
            own = Metadata(0, item.ingestion_time_ms, rest)
            parts.append(_part(batch, table, start, end, own, entry_format, sequence_column))
    return parts


def _part(
    batch: ConsumedBatch,
    table: str | None,
    start: int,
    end: int,
    item: Metadata | None,
    entry_format: EntryFormat,
    sequence_column: str | None,
) -> RoutedRows:
    """Entries ``start:end`` of ``batch`` under the one metadata ``item`` (or none)."""
    metadata = () if item is None else (item,)
    part = dataclasses.replace(batch, entries=batch.entries[start:end], metadata=metadata)
    return RoutedRows(
        table, _rows(part, entry_format, sequence_column=sequence_column, offset=start)
    )


def _rows(
    batch: ConsumedBatch, entry_format: EntryFormat, *, sequence_column: str | None, offset: int
) -> pa.Table:
    """As :func:`batch_rows`; opaque rows' ``entry_index`` counts from ``offset``."""
    if not batch.entries:
        return OPAQUE_SCHEMA.empty_table()
    if entry_format is EntryFormat.AUTO:
        entry_format = detect_format(batch)
    if entry_format is EntryFormat.OPAQUE:
        return _opaque_rows(batch, offset)
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


def _bounds(batch: ConsumedBatch) -> list[int]:
    """Where each metadata item's entries start, and the end: item i covers entries
    ``[bounds[i], bounds[i + 1])``.

    Raises:
        FormatError: the items' ``start_index`` values are not in order.
    """
    count = len(batch.entries)
    bounds = [min(item.start_index, count) for item in batch.metadata] + [count]
    if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
        raise FormatError(
            f"{batch.location} (sequence {batch.sequence}): metadata start_index values "
            f"{[item.start_index for item in batch.metadata]} are not in order",
            field="start_index",
        )
    return bounds


def _opaque_rows(batch: ConsumedBatch, offset: int = 0) -> pa.Table:
    count = len(batch.entries)
    times: list[pa.Array] = []
    payloads: list[pa.Array] = []
    # Metadata item i covers entries [start_i, start_{i+1}); entries before the first item,
    # if a producer ever wrote such a batch, get nulls.
    bounds = _bounds(batch)
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
            pa.array(range(offset, offset + count), pa.int32()),
            pa.array(batch.entries, pa.binary()),
            pa.concat_arrays(times),
            pa.concat_arrays(payloads),
        ],
        schema=OPAQUE_SCHEMA,
    )
