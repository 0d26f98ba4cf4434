"""The PostgreSQL sink, through ADBC (``adbc-driver-postgresql``).

Rows go in with ``adbc_ingest`` (binary COPY) in the same transaction as the progress row.
Binary COPY needs every value in exactly the column's type, so rows are cast to the types the
database reports for the table (an ``int32`` batch into a ``BIGINT`` column); a batch that needs
a wider column (``BIGINT`` -> ``DOUBLE PRECISION``) gets an ``ALTER COLUMN ... TYPE`` first,
inside the same transaction, so a crash leaves neither the rows nor the new type.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._adbc import AdbcSink, quote
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.errors import ConfigError

__all__ = ["PostgresSink"]

logger = logging.getLogger(__name__)

# SQLSTATE classes and codes worth retrying: connection (08), transaction rollback (40:
# serialization failure, deadlock), insufficient resources (53), operator intervention (57:
# shutdown, cancel), system error (58), lock not available, and the races of two consumers
# creating or altering the same table (unique violation on the catalog, duplicate table or
# column). 08P01, a protocol violation, means bad COPY data, which retrying cannot fix.
_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
_TRANSIENT_CODES = frozenset({"55P03", "23505", "42P07", "42701"})
_PERMANENT_CODES = frozenset({"08P01"})


class PostgresSink(AdbcSink):
    """Writes batches into a PostgreSQL table."""

    def __init__(
        self,
        url: str,
        *,
        table: str = "millpond_rows",
        entry_format: EntryFormat | str = EntryFormat.AUTO,
        sequence_column: str | None = "_millpond_sequence",
        progress_table: str = "millpond_progress",
    ) -> None:
        """Open (lazily) the database at ``url`` (``postgresql://user@host:port/db``).

        Raises:
            ConfigError: a bad URL, table name or entry format, or the driver is missing.
        """
        try:
            import adbc_driver_postgresql.dbapi  # noqa: F401 - fail at construction, not later
        except ImportError as err:
            raise ConfigError(
                "sink",
                "PostgreSQL sink needs adbc-driver-postgresql: pip install 'millpond[postgres]'",
            ) from err
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
            raise ConfigError(
                "sink", f"expected postgresql://user@host:port/database, found {redact(url)!r}"
            )
        self._url = url
        super().__init__(
            description=redact(url),
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
        )

    def _open(self) -> Any:
        import adbc_driver_postgresql.dbapi as pg_dbapi

        return pg_dbapi.connect(self._url)

    def _begin(self, conn: Any, cur: Any) -> None:
        pass  # autocommit is off: the first statement opens the transaction

    def _commit(self, conn: Any, cur: Any) -> None:
        conn.commit()

    def _rollback(self, conn: Any, cur: Any) -> None:
        conn.rollback()

    def _param(self, index: int) -> str:
        return f"${index}"

    def _sql_type(self, column: str, dtype: pa.DataType) -> str:
        t = pa.types
        if t.is_dictionary(dtype):
            dtype = dtype.value_type
        if t.is_boolean(dtype):
            return "BOOLEAN"
        if t.is_int8(dtype) or t.is_int16(dtype) or t.is_uint8(dtype):
            return "SMALLINT"
        if t.is_int32(dtype) or t.is_uint16(dtype):
            return "INTEGER"
        if t.is_integer(dtype):
            return "BIGINT"
        if t.is_float16(dtype) or t.is_float32(dtype):
            return "REAL"
        if t.is_float64(dtype):
            return "DOUBLE PRECISION"
        if t.is_string(dtype) or t.is_large_string(dtype) or t.is_string_view(dtype):
            return "TEXT"
        if (
            t.is_binary(dtype)
            or t.is_large_binary(dtype)
            or t.is_fixed_size_binary(dtype)
            or t.is_binary_view(dtype)
        ):
            return "BYTEA"
        if t.is_date(dtype):
            return "DATE"
        if t.is_timestamp(dtype):
            return "TIMESTAMPTZ" if dtype.tz is not None else "TIMESTAMP"
        if t.is_time(dtype):
            return "TIME"
        if t.is_duration(dtype) or t.is_interval(dtype):
            return "INTERVAL"
        if t.is_decimal(dtype):
            return f"NUMERIC({dtype.precision}, {dtype.scale})"
        if t.is_null(dtype):
            return "TEXT"  # a column that was all nulls so far
        raise SinkError(
            f"column {column!r}: Arrow type {dtype} has no PostgreSQL column type here",
            transient=False,
        )

    def _reflect(self, conn: Any, cur: Any) -> dict[str, pa.DataType] | None:
        import adbc_driver_manager

        exists = self._fetch(cur, "SELECT to_regclass($1) IS NOT NULL", (self._table.sql,))
        if not exists or not exists[0][0]:
            return None
        try:
            schema = conn.adbc_get_table_schema(
                self._table.name, db_schema_filter=self._table.schema
            )
        except adbc_driver_manager.ProgrammingError:
            return None
        return {field.name: field.type for field in schema}

    def _widen(self, column: str, existing: pa.DataType, incoming: pa.DataType) -> str | None:
        if existing == incoming or not _plain(existing) or pa.types.is_null(incoming):
            return None
        try:
            wide = (
                pa.unify_schemas(
                    [pa.schema([("c", existing)]), pa.schema([("c", incoming)])],
                    promote_options="permissive",
                )
                .field("c")
                .type
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
            raise SinkError(
                f"column {column!r}: the table has {existing}, the batch has {incoming}; "
                f"they cannot be reconciled ({err})",
                transient=False,
            ) from err
        old_sql = self._sql_type(column, existing)
        new_sql = self._sql_type(column, wide)
        if new_sql == old_sql:
            return None
        return (
            f"ALTER TABLE {self._table.sql} ALTER COLUMN {quote(column)} TYPE {new_sql} "
            f"USING {quote(column)}::{new_sql}"
        )

    def _conform(self, rows: pa.Table, columns: dict[str, pa.DataType]) -> pa.Table:
        arrays: list[pa.ChunkedArray] = []
        changed = False
        for field, column in zip(rows.schema, rows.columns, strict=True):
            target = columns.get(field.name)
            if target is None or target == field.type or not _plain(target):
                arrays.append(column)
                continue
            # Truncating nanoseconds to PostgreSQL's microseconds is expected, not an error.
            safe = not (pa.types.is_temporal(target) and pa.types.is_temporal(field.type))
            try:
                arrays.append(pc.cast(column, target, safe=safe))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise SinkError(
                    f"column {field.name!r}: cannot store {field.type} values in the table's "
                    f"{target} column ({err})",
                    transient=False,
                ) from err
            changed = True
        if not changed:
            return rows
        return pa.Table.from_arrays(arrays, names=rows.column_names)

    def _is_transient(self, err: Exception) -> bool:
        import adbc_driver_manager

        sqlstate = getattr(err, "sqlstate", None) or ""
        if sqlstate:
            if sqlstate in _PERMANENT_CODES:
                return False
            return sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate in _TRANSIENT_CODES
        # No SQLSTATE: the failure happened below SQL, on the connection itself.
        return isinstance(
            err, adbc_driver_manager.OperationalError | adbc_driver_manager.InterfaceError
        )

    def _driver_errors(self) -> tuple[type[Exception], ...]:
        import adbc_driver_manager

        return (adbc_driver_manager.Error,)


def _plain(dtype: pa.DataType) -> bool:
    """A type pyarrow can cast to (not a driver's opaque extension type)."""
    return not isinstance(dtype, pa.ExtensionType) and not pa.types.is_null(dtype)


def redact(url: str) -> str:
    """The URL without its password (credentials never reach logs or errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return parts._replace(netloc=netloc).geturl()
