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

import logging
import re
from typing import Any
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from millpond.consumer.sinks._adbc import LOCATION_INDEX_SUFFIX, AdbcSink, quote
from millpond.consumer.sinks._dead_letter import QUARANTINE_SUFFIX
from millpond.consumer.sinks._schema import postgres_identifier
from millpond.consumer.sinks._values import for_postgres
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.consumer.sinks.errors import ErrorClass, classify_postgres
from millpond.consumer.sinks.types import POSTGRES, ColumnType, Dialect
from millpond.errors import ConfigError

__all__ = ["PostgresSink"]

logger = logging.getLogger(__name__)


class PostgresSink(AdbcSink):
    """Writes batches into a PostgreSQL table."""

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
            secrets=_secrets(url),
            table=table,
            entry_format=entry_format,
            sequence_column=sequence_column,
            progress_table=progress_table,
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

        return pg_dbapi.connect(self._url)

    def _begin(self, conn: Any, cur: Any) -> None:
        pass  # autocommit is off: the first statement opens the transaction

    def _commit(self, conn: Any, cur: Any) -> None:
        conn.commit()

    def _rollback(self, conn: Any, cur: Any) -> None:
        conn.rollback()

    def _param(self, index: int) -> str:
        return f"${index}"

    @property
    def _dialect(self) -> Dialect:
        return POSTGRES

    def _name_key(self, name: str) -> str:
        return postgres_identifier(name)

    def _reflect(self, cur: Any) -> dict[str, ColumnType] | None:
        # The catalog's own spelling of each type (format_type) keeps what ADBC's Arrow
        # schema loses: numeric precision and scale, varchar lengths, json vs text.
        rows = self._fetch(
            cur,
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum",
            (self._table.sql,),
        )
        if not rows:
            exists = self._fetch(cur, "SELECT to_regclass($1) IS NOT NULL", (self._table.sql,))
            return {} if exists and exists[0][0] else None
        return {str(name): POSTGRES.parse(str(sql)) for name, sql in rows}

    def _lock_schema(self, cur: Any) -> None:
        # A transaction-scoped advisory lock per table: two consumers creating or altering
        # the same table take turns instead of failing on each other's DDL.
        self._fetch(cur, "SELECT pg_advisory_xact_lock(hashtext($1))", (f"millpond:{self._table}",))

    def _lock_setup(self, cur: Any) -> None:
        # CREATE ... IF NOT EXISTS is not safe against a concurrent CREATE of the same name:
        # the later session can fail with 42710 "type ... already exists" (permanent) or 23505
        # on pg_type. Sessions setting up take turns; setups are rare (one per connection),
        # so one lock serves every sink of the database.
        self._fetch(cur, "SELECT pg_advisory_xact_lock(hashtext($1))", ("millpond:setup",))

    def _retype(self, cur: Any, column: str, new: ColumnType, *, empty: bool) -> None:
        sql = POSTGRES.sql_type(new)
        cur.execute(
            f"ALTER TABLE {self._table.sql} ALTER COLUMN {quote(column)} TYPE {sql} "
            f"USING {'NULL' if empty else quote(column)}::{sql}"
        )

    def _conform(self, rows: pa.Table, columns: dict[str, ColumnType]) -> pa.Table:
        arrays: list[pa.ChunkedArray] = []
        for name, values in zip(rows.column_names, rows.columns, strict=True):
            column = columns[name]
            try:
                arrays.append(for_postgres(values, column))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
                raise SinkError(
                    f"table {self._table}, column {name!r}: cannot store {values.type} values "
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

    def _driver_errors(self) -> tuple[type[Exception], ...]:
        import adbc_driver_manager

        return (adbc_driver_manager.Error,)


def redact(url: str) -> str:
    """The URL without its passwords (credentials never reach logs or errors).

    Done on the text, not on a parse: a password with a ``#``, ``?`` or ``/`` left unescaped
    ends the URL's authority early for :func:`~urllib.parse.urlsplit`, which then finds no
    password at all. Everything between ``user:`` and the last ``@`` goes, and the value of a
    ``password`` or ``sslpassword`` query parameter (libpq reads both).
    """
    split = _split_password(url)
    if split is not None:
        url = f"{split[0]}***{split[2]}"
    return _PASSWORD_PARAMETER.sub(r"\1***", url)


def _secrets(url: str) -> list[str]:
    """What of ``url`` :func:`redact` hides, as written and percent-decoded (libpq's messages
    quote a value it could not decode)."""
    split = _split_password(url)
    found = [split[1]] if split is not None else []
    found += [m.group(2) for m in _PASSWORD_PARAMETER.finditer(url)]
    found += [unquote(secret) for secret in found]
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def _split_password(url: str) -> tuple[str, str, str] | None:
    """``(up to "user:", the password, from the last "@")``, or ``None`` without one."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return None
    userinfo, at, host = rest.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return (f"{scheme}{sep}{user}:", password, f"{at}{host}") if colon else None


_PASSWORD_PARAMETER = re.compile(r"(?i)([?&](?:ssl)?password=)([^&#]*)")
