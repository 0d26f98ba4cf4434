"""Reading what a sink recorded, without writing anything: for ``millpond status --sink``.

Every batch the consumer writes leaves a row in the sink's progress table (sequence, location,
row count, commit time) in the same transaction as its rows, so the progress table says how
far the database is, whether or not a consumer is running. :class:`ProgressReader` sums it
incrementally: the first read scans the target table's progress rows once, later reads only
the rows past the highest sequence seen (a range of the primary key), so a ``--watch`` costs
little however long the history.

Read-only: SQLite is opened with ``mode=ro`` (a missing file is an error, never a new empty
database) and PostgreSQL only runs ``SELECT``s in a transaction it rolls back.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote as url_quote
from urllib.parse import unquote, urlsplit

from millpond.consumer.sinks._adbc import TableName
from millpond.consumer.sinks.postgres import redact
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
        ConfigError: an unsupported URL or a bad table name.
        """
        self._url = url
        self._target = str(TableName.parse("table", table))
        self._progress = TableName.parse("progress_table", progress_table)
        scheme = urlsplit(url).scheme
        if scheme not in ("sqlite", "postgresql", "postgres"):
            raise ConfigError("sink", f"expected sqlite:///path or postgresql://..., found {url!r}")
        self._total = SinkProgress(rows=0, batches=0, last_sequence=None, last_commit_ms=None)

    def read(self) -> SinkProgress:
        """The totals now (one query for the rows past the last read).

        Raises:
            ConfigError: no SQLite database file at the URL's path.
            NotFoundError: no progress table yet (nothing consumed into it).
            StorageError: the database could not be reached or queried.
        """
        after = -1 if self._total.last_sequence is None else self._total.last_sequence
        sql = (
            "SELECT COALESCE(SUM(CASE WHEN duplicate THEN 0 ELSE row_count END), 0), "
            "COALESCE(SUM(CASE WHEN duplicate THEN 0 ELSE 1 END), 0), "
            f"MAX(sequence), MAX(committed_at_ms) FROM {self._progress.sql} "
            "WHERE target_table = {p1} AND sequence > {p2}"
        )
        rows, batches, last, at = self._query(sql, (self._target, after))
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

    def _query(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
        if urlsplit(self._url).scheme == "sqlite":
            return self._sqlite(sql.format(p1="?", p2="?"), params)
        return self._postgres(sql.format(p1="$1", p2="$2"), params)

    def _sqlite(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
        path = unquote(urlsplit(self._url).path)
        if not Path(path).is_file():  # a typo: say so, and never create an empty database
            raise ConfigError("sink", f"expected an SQLite database file, found none at {path}")
        try:
            conn = sqlite3.connect(f"file:{url_quote(path)}?mode=ro", uri=True, timeout=10)
        except sqlite3.OperationalError as err:
            raise StorageError(f"sink {self._url}: cannot open {path}: {err}") from err
        with contextlib.closing(conn):
            try:
                row = conn.execute(sql, params).fetchone()
            except sqlite3.OperationalError as err:
                if "no such table" in str(err):
                    raise NotFoundError(
                        f"sink {self._url}: no progress table {self._progress} yet "
                        "(no consumer has written there)"
                    ) from err
                raise StorageError(f"sink {self._url}: {err}") from err
        return tuple(row)

    def _postgres(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
        import adbc_driver_postgresql.dbapi as pg_dbapi

        where = redact(self._url)
        try:
            conn = pg_dbapi.connect(self._url)
        except pg_dbapi.Error as err:
            raise StorageError(f"sink {where}: cannot connect: {err}") from err
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                row = cur.fetchone()
        except pg_dbapi.Error as err:
            if "does not exist" in str(err):
                raise NotFoundError(
                    f"sink {where}: no progress table {self._progress} yet "
                    "(no consumer has written there)"
                ) from err
            raise StorageError(f"sink {where}: {err}") from err
        finally:
            with contextlib.suppress(pg_dbapi.Error):
                conn.rollback()
            conn.close()
        assert row is not None
        return tuple(row)
