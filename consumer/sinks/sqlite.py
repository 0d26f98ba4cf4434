"""The embedded sink: a SQLite database file, through ADBC (``adbc-driver-sqlite``).

The connection runs in autocommit mode and brackets each write in ``BEGIN IMMEDIATE`` ...
``COMMIT``: the write lock is taken before the progress row is read, so two processes on one
file serialize instead of failing at commit. WAL journaling lets readers (``sqlite3``, a status
query) look at the table while the consumer writes; ``synchronous=FULL`` makes every commit
durable before the consumer acks it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from millpond.consumer.sinks._adbc import AdbcSink, quote
from millpond.consumer.sinks.base import EntryFormat
from millpond.errors import ConfigError

__all__ = ["SQLiteSink"]

logger = logging.getLogger(__name__)

# How long a writer waits for another process's lock before SQLite reports "busy".
_BUSY_TIMEOUT_MS = 30_000
_TRANSIENT_WORDS = ("locked", "busy", "duplicate column", "already exists")


class SQLiteSink(AdbcSink):
    """Writes batches into a table of a SQLite database file."""

    def __init__(
        self,
        path: str | Path,
        *,
        table: str = "millpond_rows",
        entry_format: EntryFormat | str = EntryFormat.AUTO,
        sequence_column: str | None = "_millpond_sequence",
        progress_table: str = "millpond_progress",
    ) -> None:
        """Open (lazily) the database at ``path``; it is created on first use.

        Raises:
            ConfigError: a bad table name or entry format, or adbc-driver-sqlite missing.
        """
        try:
            import adbc_driver_sqlite.dbapi  # noqa: F401 - fail at construction, not later
        except ImportError as err:
            raise ConfigError(
                "sink", "SQLite sink needs adbc-driver-sqlite: pip install 'millpond[sqlite]'"
            ) from err
        self._path = Path(path)
        if str(path) in ("", ":memory:"):
            raise ConfigError("sink", f"expected a database file path, found {str(path)!r}")
        super().__init__(
            description=f"sqlite://{self._path.resolve()}",
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
        )

    @property
    def path(self) -> Path:
        return self._path

    def _open(self) -> Any:
        import adbc_driver_sqlite.dbapi as sqlite_dbapi

        self._path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite_dbapi.connect(str(self._path), autocommit=True)
        cur = conn.cursor()
        try:
            # The timeout first: switching to WAL takes a lock another process may hold.
            cur.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            cur.fetchall()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.fetchall()
            cur.execute("PRAGMA synchronous=FULL")
        finally:
            cur.close()
        return conn

    def _begin(self, conn: Any, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _commit(self, conn: Any, cur: Any) -> None:
        cur.execute("COMMIT")

    def _rollback(self, conn: Any, cur: Any) -> None:
        cur.execute("ROLLBACK")

    def _param(self, index: int) -> str:
        return "?"

    def _sql_type(self, column: str, dtype: pa.DataType) -> str:
        if pa.types.is_dictionary(dtype):
            dtype = dtype.value_type
        if pa.types.is_boolean(dtype):
            return "BOOLEAN"
        if pa.types.is_integer(dtype):
            return "INTEGER"
        if pa.types.is_floating(dtype):
            return "REAL"
        if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
            return "TEXT"
        if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
            return "BLOB"
        # No declared type: no affinity, so SQLite keeps values exactly as the driver binds
        # them (a TEXT column would turn integer timestamps into strings).
        return ""

    def _reflect(self, conn: Any, cur: Any) -> dict[str, pa.DataType] | None:
        schema = f"{quote(self._table.schema)}." if self._table.schema else ""
        cur.execute(f"PRAGMA {schema}table_info({quote(self._table.name)})")
        rows = cur.fetchall()
        if not rows:
            return None
        # SQLite columns take any value; only the names matter here.
        return {str(row[1]): pa.null() for row in rows}

    def _widen(self, column: str, existing: pa.DataType, incoming: pa.DataType) -> str | None:
        return None  # dynamic typing: a column already holds any value

    def _conform(self, rows: pa.Table, columns: dict[str, pa.DataType]) -> pa.Table:
        return rows

    def _is_transient(self, err: Exception) -> bool:
        text = str(err).lower()
        return any(word in text for word in _TRANSIENT_WORDS)

    def _driver_errors(self) -> tuple[type[Exception], ...]:
        import adbc_driver_manager

        return (adbc_driver_manager.Error,)
