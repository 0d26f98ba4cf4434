"""Rows into one table, inside the sink's transaction: create or evolve the table, then append
the rows or merge them by key (a mixin of :class:`~millpond.consumer.sinks.AdbcSink`).

Append: the rows go in with ``adbc_ingest`` (binary COPY on PostgreSQL).

Upsert (:mod:`millpond.consumer.sinks._merge`): per run of writes with the same columns, the
keys some row deletes are copied into a temporary table and deleted with one statement
(``DELETE ... USING`` on PostgreSQL), then the last row of each key is copied into another
temporary table and merged with one ``INSERT ... SELECT ... ON CONFLICT (key) DO UPDATE``. The
temporary tables are the target's own columns (``CREATE TEMP TABLE ... AS SELECT ... WITH NO
DATA`` on PostgreSQL, the same declared types on SQLite), so the copy needs no cast. A table
the sink creates for an upsert gets ``PRIMARY KEY (key)``; an existing table must have a unique
index on exactly the key columns, or the write is refused naming the index to create.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.consumer.sinks._merge import (
    delete_sql,
    index_hint,
    key_columns,
    last_per_key,
    runs,
    split_marker,
    upsert_sql,
)
from millpond.consumer.sinks._names import TableName, quote
from millpond.consumer.sinks._schema import SchemaPlan, plan_schema, unreconcilable
from millpond.consumer.sinks.base import SinkError
from millpond.formats.arrow import unify_tables

if TYPE_CHECKING:
    from millpond.consumer.sinks._targets import Target
    from millpond.consumer.sinks.types import ColumnType, Dialect

__all__ = ["TableWriter"]

logger = logging.getLogger(__name__)

_stages = itertools.count()


@dataclass(frozen=True, slots=True)
class _Copy:
    """Rows (named as ``table``'s columns) to bulk-insert into ``table``, or into ``into``, a
    temporary table shaped like it."""

    rows: pa.Table
    columns: dict[str, ColumnType]
    table: TableName
    into: TableName | None = None


class TableWriter(ABC):
    """Create, evolve and fill one table in the caller's transaction; the dialect supplies
    the statements (the abstract methods at the end)."""

    _INSERT_SLICE_ROWS: int | None = None
    """Rows conformed at a time while the slice before is inserted (:meth:`_copy`);
    ``None``: every row at once."""
    _dialect: Dialect
    """How this database spells column types (each dialect sets it)."""

    if TYPE_CHECKING:
        _after_commit: list[Callable[[], None]]
        _writing: TableName | None

    def _write_targets(self, cur: Any, writes: Sequence[tuple[Target, Sequence[pa.Table]]]) -> None:
        """Write each target's tables (in queue order) as its settings say.

        The appends are copied last, as one stream of slices (:meth:`_copy_many`): a group
        spread over ten tables holds a tenth of its rows per table, each of which alone would
        be too few to conform a slice while the one before is copied.

        Raises:
            FormatError: the tables' schemas clash.
            SinkError: as :meth:`_prepare_table` and :meth:`_upsert`; the driver's errors.
        """
        appends: list[_Copy] = []
        for target, tables in writes:
            self._writing = target.table  # what a driver error names
            if target.settings.upsert:
                for run in runs(tables, self._name_key):
                    self._upsert(cur, target, run)
                continue
            combined = tables[0] if len(tables) == 1 else unify_tables(tables)
            rows, columns = self._prepare_table(cur, target, combined)
            appends.append(_Copy(rows, columns, target.table))
        self._copy_many(cur, appends)

    def _upsert(self, cur: Any, target: Target, rows: pa.Table) -> None:
        """Merge one run of rows into ``target`` by its key (module docstring).

        Raises:
            SinkError: a key column missing or null, a delete marker that is not boolean, no
                unique index on the key (permanent, naming the index to create).
        """
        settings, table = target.settings, str(target.table)
        rows, marks = split_marker(rows, settings.delete_column, self._name_key, table)
        key_columns(rows, settings.key, self._name_key, table)
        rows, columns = self._prepare_table(cur, target, rows)
        self._check_key(cur, target)
        key = key_columns(rows, settings.key, self._name_key, table)
        merge = last_per_key(rows, key, marks)
        sqlite = self._dialect.name == "SQLite"
        for what, part in (("delete", merge.deletes), ("upsert", merge.upserts)):
            if not part.num_rows:
                continue
            name = f"millpond_{what}_{next(_stages)}"
            stage = self._stage(cur, target.table, part.column_names, name)
            self._copy(cur, part, columns, target.table, into=stage)
            if what == "delete":
                cur.execute(delete_sql(target.table, stage, key, sqlite=sqlite))
            else:
                cur.execute(upsert_sql(target.table, stage, part.column_names, key, sqlite=sqlite))
            self._unstage(cur, stage)

    def _check_key(self, cur: Any, target: Target) -> None:
        """Refuse ``target`` unless a unique index covers exactly its key columns.

        Raises:
            SinkError: none does (permanent, naming the statement that makes one).
        """
        if target.key_checked:
            return
        key = target.settings.key
        wanted = frozenset(self._name_key(column) for column in key)
        if wanted not in self._unique_keys(cur, target.table):
            raise SinkError(
                f"table {target.table}: an upsert by ({', '.join(key)}) needs a unique index on "
                "exactly those columns (ON CONFLICT finds rows by it), and the table has none; "
                f"create one: {index_hint(target.table, key)}",
                transient=False,
            )
        self._after_commit.append(lambda: setattr(target, "key_checked", True))

    def _copy(
        self,
        cur: Any,
        rows: pa.Table,
        columns: dict[str, ColumnType],
        table: TableName,
        *,
        into: TableName | None = None,
    ) -> None:
        """Bulk-insert ``rows`` (named as ``table``'s columns) into ``table``, or into the
        temporary table ``into`` shaped like it (:meth:`_copy_many`).

        Raises:
            SinkError: as :meth:`_conform`; the driver's errors.
        """
        self._copy_many(cur, [_Copy(rows, columns, table, into)])

    def _copy_many(self, cur: Any, copies: Sequence[_Copy]) -> None:
        """Bulk-insert each copy's rows, in order.

        With :attr:`_INSERT_SLICE_ROWS` set, the rows are conformed a slice at a time, the
        next slice (of the same copy or the next) on a thread while the database takes the
        last: the driver lets go of the GIL while it copies, and conforming (JSON text above
        all) is most of the Python work of a write.

        Raises:
            SinkError: as :meth:`_conform`; the driver's errors.
        """
        size = self._INSERT_SLICE_ROWS
        slices: list[tuple[_Copy, int, int]] = []
        for copy in copies:
            count = copy.rows.num_rows
            if size is None or count <= size:
                slices.append((copy, 0, count))
            else:
                slices += [(copy, start, size) for start in range(0, count, size)]

        def conform(piece: tuple[_Copy, int, int]) -> pa.Table:
            copy, start, length = piece
            return self._conform(copy.rows.slice(start, length), copy.columns, copy.table)

        def ingest(piece: tuple[_Copy, int, int], conformed: pa.Table) -> None:
            copy = piece[0]
            self._writing = copy.table
            destination = copy.table if copy.into is None else copy.into
            self._ingest(cur, conformed, destination, temporary=copy.into is not None)

        if size is None or len(slices) <= 1:
            for piece in slices:
                ingest(piece, conform(piece))
            return
        with ThreadPoolExecutor(1, thread_name_prefix="millpond-conform") as pool:
            ahead = pool.submit(conform, slices[0])
            for piece, following in itertools.pairwise(slices):
                conformed = self._conformed(ahead, piece[0])
                ahead = pool.submit(conform, following)
                ingest(piece, conformed)
            ingest(slices[-1], self._conformed(ahead, slices[-1][0]))

    def _conformed(self, ahead: Future[pa.Table], copy: _Copy) -> pa.Table:
        try:
            return ahead.result()
        except SinkError:
            # Say it as conforming every row at once says it (row positions in the copy,
            # not in a slice): the same error, or, should that pass, the slice's.
            self._conform(copy.rows, copy.columns, copy.table)
            raise

    def _prepare_table(
        self, cur: Any, target: Target, rows: pa.Table
    ) -> tuple[pa.Table, dict[str, ColumnType]]:
        """Create or evolve ``target`` for ``rows``; return them named as its columns, and
        the columns (:meth:`_conform` makes the values what the columns take).

        Raises:
            SinkError: permanent when the rows cannot go into the table (see
                :func:`plan_schema`); the driver's errors otherwise.
        """
        table = target.table
        columns = target.columns if target.columns is not None else self._reflect(cur, table)
        plan = self._plan(rows, columns, table)
        if plan.has_ddl:
            # Another consumer may be changing the same table (or did, and our cached columns
            # are stale): take the schema lock, then decide again on what the table is now.
            self._lock_schema(cur, table)
            columns = self._reflect(cur, table)
            plan = self._plan(rows, columns, table)
            if plan.has_ddl:
                self._apply(cur, target, plan)
                columns = self._reflect(cur, table)
                # The database may have stored a name other than the one asked for
                # (PostgreSQL cuts names at 63 bytes): map the rows onto what it made.
                plan = self._plan(rows, columns, table)
                if plan.has_ddl:
                    raise SinkError(
                        f"table {table}: still needs {plan.changes or 'creating'} after "
                        "its schema was changed; refusing to change it again",
                        transient=False,
                    )
        if columns is None:
            raise SinkError(f"table {table} is missing after it was created", transient=True)
        target.columns = columns
        kept = [name for name in rows.column_names if plan.targets.get(name) is not None]
        rows = rows.select(kept).rename_columns([str(plan.targets[name]) for name in kept])
        return rows, columns

    def _plan(
        self, rows: pa.Table, columns: dict[str, ColumnType] | None, table: TableName
    ) -> SchemaPlan:
        return plan_schema(
            rows, columns, name_key=self._name_key, table=str(table), database=self._dialect.name
        )

    def _apply(self, cur: Any, target: Target, plan: SchemaPlan) -> None:
        dialect, table = self._dialect, target.table
        if plan.create is not None:
            self._create(cur, target, plan.create)
        for change in plan.changes:
            if change.action == "add":
                # Drifted schema: a new column, nullable so older rows read as NULL.
                cur.execute(
                    f"ALTER TABLE {table.sql} ADD COLUMN {quote(change.column)} "
                    f"{dialect.sql_type(change.new)}"
                )
                logger.info("added column %s %s to %s", change.column, change.new, table)
                continue
            empty = change.action == "retype_if_empty"
            if empty and not self._holds_only_nulls(cur, table, change.column):
                assert change.existing is not None
                raise unreconcilable(
                    str(table), change, dialect.name, dialect.sql_type(change.existing)
                )
            self._retype(cur, table, change.column, change.new, empty=empty)
            logger.info(
                "changed column %s of %s from %s to %s%s",
                change.column,
                table,
                change.existing,
                change.new,
                " (it held only NULLs)" if empty else "",
            )

    def _create(self, cur: Any, target: Target, create: list[tuple[str, ColumnType]]) -> None:
        """``CREATE TABLE`` for ``create``; an upsert's key columns ``NOT NULL`` and its
        primary key."""
        dialect, table = self._dialect, target.table
        key = {self._name_key(column) for column in target.settings.key}
        primary = [name for name, _ in create if self._name_key(name) in key]
        definitions = [
            f"{quote(name)} {dialect.sql_type(column)}"
            + (" NOT NULL" if self._name_key(name) in key else "")
            for name, column in create
        ]
        if primary:
            definitions.append(f"PRIMARY KEY ({', '.join(quote(name) for name in primary)})")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table.sql} ({', '.join(definitions)})")
        logger.info(
            "created table %s with %s columns (%s)",
            table,
            len(create),
            target.settings.describe(),
        )

    def _holds_only_nulls(self, cur: Any, table: TableName, column: str) -> bool:
        rows = self._fetch(
            cur, f"SELECT 1 FROM {table.sql} WHERE {quote(column)} IS NOT NULL LIMIT 1", ()
        )
        return not rows

    # -- dialect ---------------------------------------------------------------------------

    @abstractmethod
    def _name_key(self, name: str) -> str:
        """A column name as the database compares names (two names, one key: one column)."""

    @abstractmethod
    def _reflect(self, cur: Any, table: TableName) -> dict[str, ColumnType] | None:
        """``table``'s columns in order, or ``None`` when it does not exist."""

    @abstractmethod
    def _lock_schema(self, cur: Any, table: TableName) -> None:
        """Serialize DDL on ``table`` with other writers until the transaction ends."""

    @abstractmethod
    def _unique_keys(self, cur: Any, table: TableName) -> list[frozenset[str]]:
        """The column sets (as :meth:`_name_key` gives names) of ``table``'s unique indexes
        and constraints that ``ON CONFLICT`` can use: not partial, not on expressions, not
        deferred."""

    @abstractmethod
    def _stage(self, cur: Any, table: TableName, names: Sequence[str], name: str) -> TableName:
        """A new temporary table ``name`` with ``table``'s columns ``names`` (the same
        types), dropped when the transaction ends or by :meth:`_unstage`."""

    def _unstage(self, cur: Any, stage: TableName) -> None:  # noqa: B027 - optional hook
        """Drop a temporary table of :meth:`_stage` (none needed where it drops itself)."""

    @abstractmethod
    def _retype(
        self, cur: Any, table: TableName, column: str, new: ColumnType, *, empty: bool
    ) -> None:
        """Change a column's type (``empty``: it holds only NULLs, nothing to convert)."""

    @abstractmethod
    def _conform(
        self, rows: pa.Table, columns: dict[str, ColumnType], table: TableName
    ) -> pa.Table:
        """The rows (already named as ``table``'s columns) in what the columns take."""

    def _ingest(
        self, cur: Any, rows: pa.Table, table: TableName, *, temporary: bool = False
    ) -> None:
        """Bulk-insert conformed rows into ``table`` (``temporary``: one of :meth:`_stage`)."""
        if temporary:
            cur.adbc_ingest(table.name, rows, mode="append", temporary=True)
        else:
            cur.adbc_ingest(table.name, rows, mode="append", db_schema_name=table.schema)

    @staticmethod
    def _fetch(cur: Any, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        cur.execute(sql, params)
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows
