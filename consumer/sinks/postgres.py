"""The PostgreSQL sink, through ADBC (``adbc-driver-postgresql``).

Rows go in with ``adbc_ingest`` (binary COPY) in the same transaction as the progress row.
Binary COPY needs every value in exactly the column's type, so rows are cast to the types the
catalog reports for the table (an ``int32`` batch into a ``bigint`` column; nested values as
JSON text into a ``json`` column); a batch that needs a wider column (``bigint`` -> ``double
precision``) gets an ``ALTER COLUMN ... TYPE`` first, inside the same transaction, so a crash
leaves neither the rows nor the new type. Column types: :mod:`millpond.consumer.sinks.types`;
error classes: :mod:`millpond.consumer.sinks.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from millpond.consumer.sinks._adbc import LOCATION_INDEX_SUFFIX, AdbcSink, quote
from millpond.consumer.sinks._dead_letter import QUARANTINE_SUFFIX
from millpond.consumer.sinks._names import TableName
from millpond.consumer.sinks._schema import postgres_identifier
from millpond.consumer.sinks._tables import SinkTables
from millpond.consumer.sinks._url import postgres_url, redact, secrets
from millpond.consumer.sinks._values import for_postgres
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.consumer.sinks.errors import ErrorClass, classify_postgres
from millpond.consumer.sinks.types import POSTGRES, ColumnType
from millpond.errors import ConfigError

__all__ = ["PostgresSink", "redact", "resolve_postgres_table"]


class PostgresSink(AdbcSink):
    """Writes batches into a PostgreSQL table."""

    _dialect = POSTGRES
    # Binary COPY runs in the driver without the GIL: a slice of this many rows is made into
    # what the columns take while the one before is copied.
    _INSERT_SLICE_ROWS = 32_768

    def __init__(
        self,
        url: str,
        *,
        table: str = "millpond_rows",
        entry_format: EntryFormat | str = EntryFormat.AUTO,
        sequence_column: str | None = "_millpond_sequence",
        progress_table: str = "millpond_progress",
        tables: SinkTables | None = None,
    ) -> None:
        """Open (lazily) the database at ``url`` (``postgresql://user@host:port/db``).

        ``tables``: the tables besides ``table`` that batches may name, and how each (and
        ``table``) takes its rows (:class:`SinkTables`); default: ``table`` alone, appended.

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
        self._url = postgres_url(url)
        super().__init__(
            description=redact(url),
            secrets=secrets(url),
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
            tables=tables,
        )
        # PostgreSQL cuts a longer name without a word: two spellings of one table would key
        # its progress apart (a batch written twice), and a progress table's quarantine
        # sibling could be cut back onto it.
        progress = self._progress.name
        for key, name, what in (
            ("table", self._table.schema, "schema"),
            ("table", self._table.name, "table"),
            ("progress_table", self._progress.schema, "schema"),
            ("progress_table", progress + QUARANTINE_SUFFIX, "quarantine table"),
            ("progress_table", progress + LOCATION_INDEX_SUFFIX, "index"),
        ):
            if name and postgres_identifier(name) != name:
                raise ConfigError(
                    key,
                    f"the {what} name {name!r} is {len(name.encode())} bytes, and PostgreSQL "
                    "keeps the first 63 bytes of a name",
                )

    def _open(self) -> Any:
        import adbc_driver_postgresql.dbapi as pg_dbapi

        # Autocommit on, and the sink says BEGIN and COMMIT itself: with autocommit off the
        # driver sends BEGIN before every bulk ingest, inside the transaction already open,
        # and the server logs a warning ("there is already a transaction in progress") for
        # every COPY, besides a round trip each.
        return pg_dbapi.connect(self._url, autocommit=True)

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN")

    def _param(self, index: int) -> str:
        return f"${index}"

    def _name_key(self, name: str) -> str:
        return postgres_identifier(name)

    def _reflect(self, cur: Any, table: TableName) -> dict[str, ColumnType] | None:
        # The catalog's own spelling of each type (format_type) keeps what ADBC's Arrow
        # schema loses: numeric precision and scale, varchar lengths, json vs text.
        rows = self._fetch(
            cur,
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum",
            (table.sql,),
        )
        if not rows:
            return {} if self._exists(cur, table) else None
        return {str(name): POSTGRES.parse(str(sql)) for name, sql in rows}

    def _unique_keys(self, cur: Any, table: TableName) -> list[frozenset[str]]:
        rows = self._fetch(
            cur,
            "SELECT i.indexrelid, a.attname FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indimmediate "
            "AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL",
            (table.sql,),
        )
        found: dict[Any, set[str]] = {}
        for index, column in rows:
            found.setdefault(index, set()).add(self._name_key(str(column)))
        return [frozenset(columns) for columns in found.values()]

    def _stage(self, cur: Any, table: TableName, names: Sequence[str], name: str) -> TableName:
        # Typed by the catalog itself (numeric(p,s), varchar(n), json): binary COPY takes
        # what the target's columns take. Dropped at commit (or with a rollback).
        columns = ", ".join(quote(column) for column in names)
        cur.execute(
            f"CREATE TEMP TABLE {quote(name)} ON COMMIT DROP AS SELECT {columns} "
            f"FROM {table.sql} WITH NO DATA"
        )
        return TableName(name, "pg_temp")

    def _resolve(self, cur: Any, table: TableName) -> TableName:
        return resolve_postgres_table(lambda sql, params: self._fetch(cur, sql, params), table)

    def _name_problem(self, table: TableName) -> str | None:
        for part in (table.schema, table.name):
            if part and postgres_identifier(part) != part:
                return (
                    f"{part!r} is {len(part.encode())} bytes, and PostgreSQL keeps the first "
                    "63 bytes of a name"
                )
        return None

    def _exists(self, cur: Any, table: TableName) -> bool:
        found = self._fetch(cur, "SELECT to_regclass($1) IS NOT NULL", (table.sql,))
        return bool(found and found[0][0])

    def _lock_schema(self, cur: Any, table: TableName) -> None:
        # A transaction-scoped advisory lock per table: two consumers creating or altering
        # the same table take turns instead of failing on each other's DDL.
        self._fetch(cur, "SELECT pg_advisory_xact_lock(hashtext($1))", (f"millpond:{table}",))

    def _lock_setup(self, cur: Any) -> None:
        # CREATE ... IF NOT EXISTS is not safe against a concurrent CREATE of the same name:
        # the later session can fail with 42710 "type ... already exists" (permanent) or 23505
        # on pg_type. Sessions setting up take turns; setups are rare (one per connection),
        # so one lock serves every sink of the database.
        self._fetch(cur, "SELECT pg_advisory_xact_lock(hashtext($1))", ("millpond:setup",))

    def _retype(
        self, cur: Any, table: TableName, column: str, new: ColumnType, *, empty: bool
    ) -> None:
        sql = POSTGRES.sql_type(new)
        cur.execute(
            f"ALTER TABLE {table.sql} ALTER COLUMN {quote(column)} TYPE {sql} "
            f"USING {'NULL' if empty else quote(column)}::{sql}"
        )

    def _conform(
        self, rows: pa.Table, columns: dict[str, ColumnType], table: TableName
    ) -> pa.Table:
        arrays: list[pa.ChunkedArray] = []
        for name, values in zip(rows.column_names, rows.columns, strict=True):
            column = columns[name]
            try:
                arrays.append(for_postgres(values, column))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise SinkError(
                    f"table {table}, column {name!r}: cannot store {values.type} values "
                    f"in the table's {POSTGRES.sql_type(column)} column ({err})",
                    transient=False,
                ) from err
        return pa.Table.from_arrays(arrays, names=rows.column_names)

    def _classify(self, err: Exception) -> ErrorClass:
        import adbc_driver_manager

        details = dict(getattr(err, "details", None) or ())
        constraint = details.get(b"PG_DIAG_CONSTRAINT_NAME")
        return classify_postgres(
            getattr(err, "sqlstate", None),
            connection_level=isinstance(
                err, adbc_driver_manager.OperationalError | adbc_driver_manager.InterfaceError
            ),
            constraint=constraint.decode(errors="replace") if constraint else None,
            message=str(err),
        )


def resolve_postgres_table(
    fetch: Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]], table: TableName
) -> TableName:
    """``table`` schema-qualified, as PostgreSQL resolves it for the sink's statements.

    A schema given is kept. Without one, an existing table is where ``search_path`` finds it
    (the catalog says), and a table not yet created is where ``CREATE TABLE`` would put it
    (``current_schema()``). Each part is exact: the sink quotes it, so PostgreSQL folds nothing.

    Args:
        fetch: runs a query with ``$n`` parameters, returns its rows.
        table: the table as given.

    Raises:
        SinkError: no schema in ``search_path`` to create the table in (permanent).
    """
    if table.schema is not None:
        return table
    found = fetch(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
        (table.sql,),
    )
    if found:
        return TableName(name=str(found[0][1]), schema=str(found[0][0]))
    current = fetch("SELECT current_schema()", ())
    if not current or current[0][0] is None:
        raise SinkError(
            f"table {table}: expected a schema in search_path to create it in, found none; "
            f"name it schema.{table.name}",
            transient=False,
        )
    return TableName(name=table.name, schema=str(current[0][0]))
