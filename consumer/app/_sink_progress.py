"""Reading what a sink recorded, without writing anything: for ``millpond status --sink``.

Every batch the consumer writes leaves a row in the sink's progress table (sequence, location,
row count, commit time) in the same transaction as its rows, so the progress table says how
far the database is, whether or not a consumer is running. :class:`ProgressReader` sums it
incrementally: the first read scans the target table's progress rows once, later reads only
the rows past the highest sequence seen (a range of the primary key), so a ``--watch`` costs
little however long the history.

Read-only: SQLite is opened with ``mode=ro`` (a missing file is an error, never a new empty
database) and PostgreSQL only runs ``SELECT``s in a transaction it rolls back.

The URL is read as every other command reads ``--sink``
(:func:`~millpond.consumer.sinks.parse_sink_url`), and the table as the sink keys it: resolved
by the database (``EVENTS`` is SQLite's ``events``, ``kill3`` PostgreSQL's ``public.kill3``),
counting rows an earlier version recorded under another spelling of it until a consumer moves
them to the resolved name.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote as url_quote

from millpond.consumer.sinks import parse_sink_url, redact
from millpond.consumer.sinks._names import TableName, same_table, spellings_sql, sqlite_table
from millpond.consumer.sinks._schema import ascii_casefold, postgres_identifier
from millpond.consumer.sinks.postgres import resolve_postgres_table
from millpond.errors import ConfigError, NotFoundError, StorageError

__all__ = ["ProgressReader", "SinkProgress"]


@dataclass(frozen=True, slots=True)
class SinkProgress:
    """What the sink recorded for one target table."""

    rows: int
    """Rows of the batches written (skipped duplicates add none)."""
    batches: int
    """Batches written (skipped duplicates not counted)."""
    last_sequence: int | None
    """The highest sequence recorded (written or skipped); ``None`` before the first."""
    last_commit_ms: int | None
    """Wall-clock milliseconds of the newest progress row."""


class ProgressReader:
    """Sums a sink's progress rows for one target table, incrementally."""

    def __init__(self, url: str, *, table: str, progress_table: str) -> None:
        """Raises:
        ConfigError: an unsupported URL (as ``consume`` would refuse it) or a bad table name.
        """
        self._url = url
        self._sink = parse_sink_url(url)
        self._table = TableName.parse("table", table)
        self._progress = TableName.parse("progress_table", progress_table)
        # The spellings the table's progress is recorded under: found on the first read.
        self._spellings: list[str] | None = None
        self._total = SinkProgress(rows=0, batches=0, last_sequence=None, last_commit_ms=None)

    def read(self) -> SinkProgress:
        """The totals now (one query for the rows past the last read).

        Raises:
            ConfigError: no SQLite database file at the URL's path.
            NotFoundError: no progress table yet (nothing consumed into it).
            StorageError: the database could not be reached or queried.
        """
        after = -1 if self._total.last_sequence is None else self._total.last_sequence
        rows, batches, last, at = self._query(after)
        total = self._total
        self._total = SinkProgress(
            rows=total.rows + int(rows),
            batches=total.batches + int(batches),
            last_sequence=int(last) if last is not None else total.last_sequence,
            last_commit_ms=max(int(at), total.last_commit_ms or 0)
            if at is not None
            else total.last_commit_ms,
        )
        return self._total

    def _query(self, after: int) -> tuple[Any, ...]:
        """The sums over the table's progress rows past ``after``."""
        if self._sink.kind == "sqlite":
            return self._sqlite(
                lambda fetch: self._sums(fetch, after, sqlite_table, ascii_casefold, lambda _: "?")
            )
        return self._postgres(
            lambda fetch: self._sums(
                fetch,
                after,
                lambda table: resolve_postgres_table(fetch, table),
                postgres_identifier,
                lambda index: f"${index}",
            )
        )

    def _sums(
        self,
        fetch: Fetch,
        after: int,
        resolve: Callable[[TableName], TableName],
        name_key: Callable[[str], str],
        p: Callable[[int], str],
    ) -> tuple[Any, ...]:
        """Resolves the table and finds its spellings on the first call (see the module doc).

        Args:
            fetch: runs a query.
            after: the highest sequence summed before.
            resolve: the database's resolution of a table name.
            name_key: how the database compares names.
            p: the placeholder of a 1-based parameter.
        """
        if self._spellings is None:
            table = resolve(self._table)
            recorded = [row[0] for row in fetch(spellings_sql(self._progress), ())]
            others = same_table(recorded, table, resolve=resolve, name_key=name_key)
            self._spellings = [str(table), *others]

        marks = ", ".join(p(i + 2) for i in range(len(self._spellings)))
        sql = (
            "SELECT COALESCE(SUM(CASE WHEN duplicate THEN 0 ELSE row_count END), 0), "
            "COALESCE(SUM(CASE WHEN duplicate THEN 0 ELSE 1 END), 0), "
            f"MAX(sequence), MAX(committed_at_ms) FROM {self._progress.sql} "
            f"WHERE sequence > {p(1)} AND target_table IN ({marks})"
        )
        return tuple(fetch(sql, (after, *self._spellings))[0])

    def _sqlite(self, work: Callable[[Fetch], tuple[Any, ...]]) -> tuple[Any, ...]:
        path = self._sink.path
        assert path is not None
        if not path.is_file():  # a typo: say so, and never create an empty database
            raise ConfigError("sink", f"expected an SQLite database file, found none at {path}")
        try:
            conn = sqlite3.connect(f"file:{url_quote(str(path))}?mode=ro", uri=True, timeout=10)
        except sqlite3.OperationalError as err:
            raise StorageError(f"sink {self._url}: cannot open {path}: {err}") from err
        with contextlib.closing(conn):
            try:
                return work(lambda sql, params: conn.execute(sql, params).fetchall())
            except sqlite3.OperationalError as err:
                if "no such table" in str(err):
                    raise self._no_progress_table(self._url) from err
                raise StorageError(f"sink {self._url}: {err}") from err

    def _postgres(self, work: Callable[[Fetch], tuple[Any, ...]]) -> tuple[Any, ...]:
        import adbc_driver_postgresql.dbapi as pg_dbapi

        where = redact(self._url)
        try:
            conn = pg_dbapi.connect(self._sink.url)
        except pg_dbapi.Error as err:
            raise StorageError(f"sink {where}: cannot connect: {err}") from err
        try:
            with conn.cursor() as cur:

                def fetch(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
                    cur.execute(sql, params)
                    rows: list[tuple[Any, ...]] = cur.fetchall()
                    return rows

                return work(fetch)
        except pg_dbapi.Error as err:
            if "does not exist" in str(err):
                raise self._no_progress_table(where) from err
            raise StorageError(f"sink {where}: {err}") from err
        finally:
            with contextlib.suppress(pg_dbapi.Error):
                conn.rollback()
            conn.close()

    def _no_progress_table(self, where: str) -> NotFoundError:
        return NotFoundError(
            f"sink {where}: no progress table {self._progress} yet (no consumer has written there)"
        )


Fetch = Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]]
"""Runs a query with parameters; returns its rows."""
