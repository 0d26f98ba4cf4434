"""The embedded sink: a SQLite database file, through ADBC (``adbc-driver-sqlite``).

The connection runs in autocommit mode and brackets each write in ``BEGIN IMMEDIATE`` ...
``COMMIT``: the write lock is taken before the progress row is read, so two processes on one
file serialize instead of failing at commit. WAL journaling lets readers (``sqlite3``, a status
query) look at the table while the consumer writes; ``synchronous=FULL`` makes every commit
durable before the consumer acks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._adbc import AdbcSink, quote
from millpond.consumer.sinks._names import TableName, sqlite_table
from millpond.consumer.sinks._schema import ascii_casefold
from millpond.consumer.sinks._tables import SinkTables
from millpond.consumer.sinks._url import DEFAULT_BUSY_TIMEOUT_MS, sqlite_database_path
from millpond.consumer.sinks._values import for_sqlite
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.consumer.sinks.errors import ErrorClass, classify_sqlite
from millpond.consumer.sinks.types import SQLITE, ColumnType
from millpond.errors import ConfigError

__all__ = ["DEFAULT_BUSY_TIMEOUT_MS", "SQLiteSink"]

_MAX_PARAMS = 500  # bound parameters per statement, well under SQLite's limit


class SQLiteSink(AdbcSink):
    """Writes batches into a table of a SQLite database file."""

    _dialect = SQLITE

    def __init__(
        self,
        path: str | Path,
        *,
        table: str = "millpond_rows",
        entry_format: EntryFormat | str = EntryFormat.AUTO,
        sequence_column: str | None = "_millpond_sequence",
        progress_table: str = "millpond_progress",
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        tables: SinkTables | None = None,
    ) -> None:
        """Open (lazily) the database at ``path``; it is created on first use, its directory
        never (a missing one is a typo).

        ``busy_timeout_ms`` is how long a write waits for another process's lock before it
        fails with ``SQLITE_BUSY`` (transient: the service retries with backoff). ``tables``:
        the tables besides ``table`` that batches may name, and how each (and ``table``)
        takes its rows (:class:`SinkTables`); default: ``table`` alone, appended.

        Raises:
            ConfigError: a bad table name or entry format, a path whose directory does not
                exist (named), or adbc-driver-sqlite missing.
        """
        try:
            import adbc_driver_sqlite.dbapi  # noqa: F401 - fail at construction, not later
        except ImportError as err:
            raise ConfigError(
                "sink", "SQLite sink needs adbc-driver-sqlite: pip install 'millpond[sqlite]'"
            ) from err
        self._path = sqlite_database_path(path)
        self._busy_timeout_ms = busy_timeout_ms
        super().__init__(
            description=f"sqlite://{self._path.resolve()}",
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
            tables=tables,
        )

    @property
    def path(self) -> Path:
        return self._path

    def last_sequence(self, queue: str) -> int | None:
        """As :meth:`AdbcSink.last_sequence`; without a database file, ``None`` and no file
        made (connecting would create it: the first write does)."""
        if not self._path.exists():
            return None
        return super().last_sequence(queue)

    def _open(self) -> Any:
        import adbc_driver_sqlite.dbapi as sqlite_dbapi

        conn = sqlite_dbapi.connect(str(self._path), autocommit=True)
        cur = conn.cursor()
        try:
            # The timeout first: switching to WAL takes a lock another process may hold.
            cur.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            cur.fetchall()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.fetchall()
            cur.execute("PRAGMA synchronous=FULL")
        finally:
            cur.close()
        return conn

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _param(self, index: int) -> str:
        return "?"

    def _name_key(self, name: str) -> str:
        return ascii_casefold(name)

    def _reflect(self, cur: Any, table: TableName) -> dict[str, ColumnType] | None:
        rows = self._pragma(cur, table, "table_info", table.name)
        if not rows:
            return None
        return {str(row[1]): SQLITE.parse(str(row[2] or "")) for row in rows}

    def _pragma(self, cur: Any, table: TableName, pragma: str, name: str) -> list[Any]:
        schema = f"{quote(table.schema)}." if table.schema else ""
        return self._fetch(cur, f"PRAGMA {schema}{pragma}({quote(name)})", ())

    def _unique_keys(self, cur: Any, table: TableName) -> list[frozenset[str]]:
        found: list[frozenset[str]] = []
        # An INTEGER PRIMARY KEY is the rowid: no index of its own, only table_info says.
        primary = [row for row in self._pragma(cur, table, "table_info", table.name) if row[5]]
        if primary:
            found.append(frozenset(self._name_key(str(row[1])) for row in primary))
        for _, index, unique, _origin, partial in self._pragma(
            cur, table, "index_list", table.name
        ):
            if not unique or partial:
                continue
            columns = [row[2] for row in self._pragma(cur, table, "index_info", str(index))]
            if columns and all(column is not None for column in columns):
                found.append(frozenset(self._name_key(str(column)) for column in columns))
        return found

    def _stage(self, cur: Any, table: TableName, names: Sequence[str], name: str) -> TableName:
        # The target's declared types, so its values take the same affinity.
        columns = self._reflect(cur, table) or {}
        definitions = ", ".join(
            f"{quote(column)} {SQLITE.sql_type(columns[column])}" for column in names
        )
        cur.execute(f"CREATE TEMP TABLE {quote(name)} ({definitions})")
        return TableName(name, "temp")

    def _unstage(self, cur: Any, stage: TableName) -> None:
        cur.execute(f"DROP TABLE {stage.sql}")

    def _resolve(self, cur: Any, table: TableName) -> TableName:
        return sqlite_table(table)

    def _exists(self, cur: Any, table: TableName) -> bool:
        schema = f"{quote(table.schema)}." if table.schema else ""
        found = self._fetch(
            cur,
            f"SELECT 1 FROM {schema}sqlite_master WHERE type IN ('table', 'index') "
            "AND name = ? COLLATE NOCASE",
            (table.name,),
        )
        return bool(found)

    def _lock_schema(self, cur: Any, table: TableName) -> None:
        pass  # BEGIN IMMEDIATE already holds the database's write lock

    def _retype(
        self, cur: Any, target: TableName, column: str, new: ColumnType, *, empty: bool
    ) -> None:
        # SQLite cannot change a column's type: add a column of the new type, copy the values
        # over (the new column's affinity converts them), drop the old one. The column moves
        # to the end of the table.
        table = target.sql
        old = f"{column}__millpond_old"
        cur.execute(f"ALTER TABLE {table} RENAME COLUMN {quote(column)} TO {quote(old)}")
        cur.execute(f"ALTER TABLE {table} ADD COLUMN {quote(column)} {SQLITE.sql_type(new)}")
        if not empty:
            cur.execute(f"UPDATE {table} SET {quote(column)} = {quote(old)}")
        cur.execute(f"ALTER TABLE {table} DROP COLUMN {quote(old)}")

    def _conform(
        self, rows: pa.Table, columns: dict[str, ColumnType], table: TableName
    ) -> pa.Table:
        arrays: list[pa.ChunkedArray] = []
        for name, values in zip(rows.column_names, rows.columns, strict=True):
            try:
                arrays.append(for_sqlite(values, columns[name])[0])
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise SinkError(
                    f"table {table}, column {name!r}: cannot store {values.type} values "
                    f"in SQLite ({err})",
                    transient=False,
                ) from err
        return pa.Table.from_arrays(arrays, names=rows.column_names)

    def _ingest(
        self, cur: Any, rows: pa.Table, target: TableName, *, temporary: bool = False
    ) -> None:
        nans = {
            name: pc.indices_nonzero(pc.fill_null(pc.is_nan(values), False)).to_pylist()
            for name, values in zip(rows.column_names, rows.columns, strict=True)
            if pa.types.is_floating(values.type)
        }
        nans = {name: positions for name, positions in nans.items() if positions}
        if not nans:
            super()._ingest(cur, rows, target, temporary=temporary)
            return
        # SQLite stores a NaN real as NULL: the rows go in as they are, then their NaN
        # cells become the text 'NaN'. Appended rows take rowids above the largest one.
        table = target.sql
        base = self._fetch(cur, f"SELECT coalesce(max(rowid), 0) FROM {table}", ())[0][0]
        super()._ingest(cur, rows, target, temporary=temporary)
        added = self._fetch(cur, f"SELECT count(*) FROM {table} WHERE rowid > ?", (base,))
        if added[0][0] != rows.num_rows:
            raise SinkError(
                f"table {target}: cannot place NaN values: expected {rows.num_rows} new "
                f"rows after rowid {base}, found {added[0][0]}",
                transient=False,
            )
        for name, positions in nans.items():
            for start in range(0, len(positions), _MAX_PARAMS):
                chunk = positions[start : start + _MAX_PARAMS]
                cur.execute(
                    f"UPDATE {table} SET {quote(name)} = 'NaN' WHERE rowid IN "
                    f"({', '.join('?' * len(chunk))})",
                    tuple(base + 1 + position for position in chunk),
                )

    def _classify(self, err: Exception) -> ErrorClass:
        return classify_sqlite(getattr(err, "vendor_code", None), str(err))
