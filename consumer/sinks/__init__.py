"""Database sinks that make consumption exactly-once.

A sink writes each batch's rows together with its sequence and location in one transaction
(:class:`Sink`). SQLite is the embedded default; PostgreSQL is the real one. Both go through
ADBC, and both turn Arrow entries into rows of a table with their columns (created from the
first schema, extended and widened as schemas drift) and opaque entries into rows
``(sequence, entry_index, payload, ingestion_time_ms, metadata)``. Batches may name other
tables the sink is allowed to write (:class:`SinkTables`), and a table may be upserted by key
instead of appended to (:class:`TableSettings`).

```python
from millpond.consumer.sinks import open_sink
from millpond.consumer.takeover import take_over

tables = SinkTables({"orders": TableSettings("upsert", key=("order_id",))})
with open_sink("postgresql://app@db:5432/warehouse", table="events", tables=tables) as sink:
    take_over(consumer, lambda: sink.last_sequence(consumer.queue))
    ...
```
"""

from __future__ import annotations

from millpond.consumer.sinks._adbc import AdbcSink
from millpond.consumer.sinks._dead_letter import QuarantineLedger, QuarantineRow, SetAside
from millpond.consumer.sinks._rows import (
    OPAQUE_SCHEMA,
    RoutedRows,
    batch_parts,
    batch_rows,
    detect_format,
)
from millpond.consumer.sinks._tables import SinkTables, TableMode, TableSettings, load_tables
from millpond.consumer.sinks._url import SinkUrl, parse_sink_url
from millpond.consumer.sinks.base import EntryFormat, Sink, SinkError
from millpond.consumer.sinks.postgres import PostgresSink, redact
from millpond.consumer.sinks.sqlite import SQLiteSink

__all__ = [
    "OPAQUE_SCHEMA",
    "AdbcSink",
    "EntryFormat",
    "PostgresSink",
    "QuarantineLedger",
    "QuarantineRow",
    "RoutedRows",
    "SQLiteSink",
    "SetAside",
    "Sink",
    "SinkError",
    "SinkTables",
    "SinkUrl",
    "TableMode",
    "TableSettings",
    "batch_parts",
    "batch_rows",
    "detect_format",
    "load_tables",
    "open_sink",
    "parse_sink_url",
    "redact",
]


def open_sink(
    url: str,
    *,
    table: str = "millpond_rows",
    entry_format: EntryFormat | str = EntryFormat.AUTO,
    sequence_column: str | None = "_millpond_sequence",
    progress_table: str = "millpond_progress",
    tables: SinkTables | None = None,
) -> AdbcSink:
    """A sink from a URL: ``sqlite:///absolute/path.db[?busy_timeout_ms=N]`` or
    ``postgresql://...`` (libpq's URL, ``?options=-c lock_timeout=...`` and all), read by
    :func:`parse_sink_url` as every command reads ``--sink``.

    Args:
        url: where the database is.
        table: target table, ``name`` or ``schema.name``.
        entry_format: ``auto``, ``arrow`` or ``opaque`` (see :class:`EntryFormat`).
        sequence_column: for Arrow rows, a column holding each row's batch sequence; ``None``
            for none.
        progress_table: the table recording written sequences and locations.
        tables: the tables besides ``table`` that batches may name, and how each (``table``
            too) takes its rows; default: ``table`` alone, appended.

    Raises:
        ConfigError: an unsupported URL or a bad option, or a SQLite path whose directory
            does not exist.
    """
    parsed = parse_sink_url(url)
    if parsed.kind == "sqlite":
        assert parsed.path is not None
        return SQLiteSink(
            parsed.path,
            busy_timeout_ms=parsed.busy_timeout_ms,
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
            tables=tables,
        )
    return PostgresSink(
        parsed.url,
        table=table,
        entry_format=entry_format,
        sequence_column=sequence_column,
        progress_table=progress_table,
        tables=tables,
    )
