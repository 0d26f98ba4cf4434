"""Upserts: the last row per key in queue order, and the SQL that merges it. Pure: Arrow in,
Arrow and SQL text out.

A group of batches is merged in one transaction. Within it the rows of one table are taken in
queue order, one table per write (a metadata item: one ``produce()`` call, one Spark batch
object), and cut into runs of writes that carry the same columns (:func:`runs`); each run is
merged on its own, in order, so a write that lacks a column leaves that column alone whatever
writes share its batch object or its group. In a run:

* every key some row deletes (its delete marker true) is deleted, first;
* then the last row of each key, unless that row deletes it, is inserted or, when the key is
  there, replaces the row's values in the run's columns.

That is what writing the rows one at a time, in queue order, leaves — also for a key deleted
and written again in one run — and a group written again (after a crash between its commit and
its dequeue the sink skips it; ``millpond replay`` of a batch set aside) leaves the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._names import TableName, quote
from millpond.consumer.sinks._schema import postgres_identifier
from millpond.consumer.sinks.base import SinkError
from millpond.formats.arrow import unify_tables

__all__ = [
    "Merge",
    "delete_sql",
    "index_hint",
    "key_columns",
    "last_per_key",
    "runs",
    "split_marker",
    "upsert_sql",
]

_POSITION = "__millpond_position"


@dataclass(frozen=True, slots=True)
class Merge:
    """What one run of rows does to a table."""

    deletes: pa.Table
    """The key columns of every key a row deleted (each key once)."""
    upserts: pa.Table
    """The last row of each key that is not deleted by it, in queue order."""


def runs(tables: Sequence[pa.Table], name_key: Callable[[str], str]) -> list[pa.Table]:
    """Consecutive tables with the same columns (as the database compares names), unified.

    Raises:
        FormatError: two tables of a run cannot be unified.
    """
    out: list[list[pa.Table]] = []
    last: frozenset[str] | None = None
    for table in tables:
        columns = frozenset(name_key(name) for name in table.column_names)
        if columns != last or not out:
            out.append([])
        out[-1].append(table)
        last = columns
    return [run[0] if len(run) == 1 else unify_tables(run) for run in out]


def split_marker(
    rows: pa.Table, column: str | None, name_key: Callable[[str], str], table: str
) -> tuple[pa.Table, pa.ChunkedArray | None]:
    """``rows`` without the delete marker, and the marker (true: delete; nulls false).

    Raises:
        SinkError: the marker column is not boolean (permanent).
    """
    if column is None:
        return rows, None
    found = [i for i, name in enumerate(rows.column_names) if name_key(name) == name_key(column)]
    if not found:
        return rows, None
    marks = rows.column(found[0])
    if pa.types.is_null(marks.type):
        return rows.remove_column(found[0]), None
    if not pa.types.is_boolean(marks.type):
        raise SinkError(
            f"table {table}: the delete column {column!r} must be boolean, found {marks.type}",
            transient=False,
        )
    return rows.remove_column(found[0]), pc.fill_null(marks, False)


def key_columns(
    rows: pa.Table, key: Sequence[str], name_key: Callable[[str], str], table: str
) -> list[str]:
    """The names ``rows`` gives the key columns, in key order.

    Raises:
        SinkError: a key column is missing or holds a null (permanent, naming it).
    """
    names = {name_key(name): name for name in rows.column_names}
    found: list[str] = []
    for column in key:
        name = names.get(name_key(column))
        if name is None:
            raise SinkError(
                f"table {table}: the rows have no key column {column!r} (upsert by "
                f"{', '.join(key)}; they have {', '.join(rows.column_names) or 'no columns'})",
                transient=False,
            )
        nulls = rows.column(name).null_count
        if nulls:
            raise SinkError(
                f"table {table}: key column {column!r} is null in {nulls} of {rows.num_rows} "
                "rows; every row of an upsert needs its whole key",
                transient=False,
            )
        found.append(name)
    return found


def last_per_key(rows: pa.Table, key: Sequence[str], marks: pa.ChunkedArray | None) -> Merge:
    """The :class:`Merge` of one run: ``rows`` in queue order, ``key`` their key columns,
    ``marks`` their delete markers (``None``: no row deletes). Its rows are in key order (each
    key is once in each part: their order changes nothing), which the database's index takes
    faster than any other."""
    count = rows.num_rows
    positions = pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), count)), 1)
    keyed = rows.select(list(key)).append_column(_POSITION, positions)
    grouped = keyed.group_by(list(key), use_threads=False).aggregate([(_POSITION, "max")])
    last = grouped.column(f"{_POSITION}_max")
    unique = len(last) == count
    if not unique:
        last = pc.take(last, pc.sort_indices(last))
    nothing = rows.schema.empty_table().select(list(key))
    if marks is None or not pc.any(marks).as_py():
        return Merge(nothing, _by_key(rows if unique else rows.take(last), key))
    deleted = rows.select(list(key)).filter(marks)
    deletes = deleted.group_by(list(key), use_threads=False).aggregate([]).select(list(key))
    if unique:
        return Merge(_by_key(deletes, key), _by_key(rows.filter(pc.invert(marks)), key))
    kept = pc.filter(last, pc.invert(pc.take(marks, last)))
    return Merge(_by_key(deletes, key), _by_key(rows.take(kept), key))


def _by_key(rows: pa.Table, key: Sequence[str]) -> pa.Table:
    return rows.take(pc.sort_indices(rows, [(column, "ascending") for column in key]))


def upsert_sql(
    table: TableName, stage: TableName, columns: Sequence[str], key: Sequence[str], *, sqlite: bool
) -> str:
    """Insert ``stage``'s rows into ``table``, a row whose key is there replacing its values.

    SQLite needs ``WHERE true`` before ``ON CONFLICT`` in an ``INSERT ... SELECT``.
    """
    names = ", ".join(quote(c) for c in columns)
    keys = ", ".join(quote(c) for c in key)
    values = [c for c in columns if c not in set(key)]
    update = (
        "DO UPDATE SET " + ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in values)
        if values
        else "DO NOTHING"
    )
    where = " WHERE true" if sqlite else ""
    return (
        f"INSERT INTO {table.sql} ({names}) SELECT {names} FROM {stage.sql}{where} "
        f"ON CONFLICT ({keys}) {update}"
    )


def delete_sql(table: TableName, stage: TableName, key: Sequence[str], *, sqlite: bool) -> str:
    """Delete from ``table`` every row whose key is in ``stage``."""
    if sqlite:
        keys = ", ".join(quote(c) for c in key)
        return f"DELETE FROM {table.sql} WHERE ({keys}) IN (SELECT {keys} FROM {stage.sql})"
    match = " AND ".join(f"t.{quote(c)} = d.{quote(c)}" for c in key)
    return f"DELETE FROM {table.sql} AS t USING {stage.sql} AS d WHERE {match}"


def index_hint(table: TableName, key: Sequence[str]) -> str:
    """The statement that gives ``table`` the unique index an upsert by ``key`` needs."""
    name = postgres_identifier(f"{table.name}_{'_'.join(key)}_key")
    return f"CREATE UNIQUE INDEX {quote(name)} ON {table.sql} ({', '.join(quote(c) for c in key)})"
