"""Schema drift, decided before anything is written: which columns to create, add or retype.

Pure: a batch's Arrow schema and the table's reflected columns in, a :class:`SchemaPlan` out.
The sink runs the plan's DDL in the write transaction (so a crash leaves neither the rows nor
the change) and then conforms the rows to the columns.

Names are compared the way the database compares them (``name_key``): SQLite folds ASCII
case, PostgreSQL cuts identifiers at 63 bytes. Two batch columns that the database would take
for one are refused, naming both; a batch column that matches a table column under those rules
is written into it under the table's spelling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks.base import SinkError
from millpond.consumer.sinks.types import (
    ColumnType,
    Kind,
    UnsupportedTypeError,
    column_type,
    reconcile,
)

__all__ = ["ColumnChange", "SchemaPlan", "ascii_casefold", "plan_schema", "postgres_identifier"]

_POSTGRES_NAMEDATALEN = 63  # bytes PostgreSQL keeps of an identifier


def ascii_casefold(name: str) -> str:
    """SQLite's identifier comparison: ASCII letters fold case, nothing else does."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def postgres_identifier(name: str) -> str:
    """The identifier PostgreSQL stores for ``name``: at most 63 bytes, whole characters."""
    data = name.encode("utf-8")
    if len(data) <= _POSTGRES_NAMEDATALEN:
        return name
    return data[:_POSTGRES_NAMEDATALEN].decode("utf-8", errors="ignore")


@dataclass(frozen=True, slots=True)
class ColumnChange:
    """One DDL step."""

    action: str
    """``add``, ``retype`` (widen), or ``retype_if_empty`` (only if the column holds no value:
    a column created for values that never came, or for an all-null batch)."""
    column: str
    """The column's name in the table (the batch's spelling for ``add``)."""
    new: ColumnType
    existing: ColumnType | None = None
    incoming: pa.DataType | None = None
    """The batch's Arrow type (for messages)."""


@dataclass(slots=True)
class SchemaPlan:
    """What the table needs before the rows go in, and where each batch column goes."""

    create: list[tuple[str, ColumnType]] | None = None
    """Columns of a table to create (``None``: the table exists)."""
    changes: list[ColumnChange] = field(default_factory=list)
    targets: dict[str, str | None] = field(default_factory=dict)
    """Batch column -> table column (``None``: an all-null column with no table column yet,
    left out until a batch brings values)."""

    @property
    def has_ddl(self) -> bool:
        return self.create is not None or bool(self.changes)


def plan_schema(
    rows: pa.Table,
    columns: Mapping[str, ColumnType] | None,
    *,
    name_key: Callable[[str], str],
    table: str,
    database: str,
) -> SchemaPlan:
    """Decide the DDL for writing ``rows`` into a table with ``columns``.

    Args:
        rows: the batch's rows.
        columns: the table's columns in order, or ``None`` when it does not exist.
        name_key: how the database compares column names.
        table: the table's name, for messages.
        database: ``SQLite`` or ``PostgreSQL``, for messages.

    Raises:
        SinkError: permanent: two batch columns are one column in the database, a column's
            Arrow type has no column type, or a type cannot be reconciled with the table's.
    """
    _check_names(rows, name_key=name_key, table=table, database=database)
    plan = SchemaPlan()
    existing = {name_key(name): name for name in columns or {}}
    if columns is None:
        plan.create = []
    for schema_field, values in zip(rows.schema, rows.columns, strict=True):
        name = schema_field.name
        incoming = _column_type(schema_field, table=table, database=database)
        actual = existing.get(name_key(name))
        if actual is None or columns is None:
            _plan_new_column(plan, name, incoming)
            continue
        plan.targets[name] = actual
        if incoming is None:
            continue
        change = _retype(actual, columns[actual], incoming, values, schema_field.type)
        if change is not None:
            plan.changes.append(change)
    if plan.create == []:
        # Every column is all-null so far: create them as text; the first batch with values
        # retypes them (they hold nothing but NULLs).
        plan.create = [(name, ColumnType(Kind.STRING)) for name in rows.column_names]
        plan.targets = {name: name for name in rows.column_names}
    return plan


def _check_names(
    rows: pa.Table, *, name_key: Callable[[str], str], table: str, database: str
) -> None:
    """Refuse batch column names the database cannot hold apart (or, on PostgreSQL, at all).

    Raises:
        SinkError: permanent: an empty name on PostgreSQL, or two batch columns that are one
            column in the database.
    """
    seen: dict[str, str] = {}
    for position, name in enumerate(rows.column_names):
        if not name and database == "PostgreSQL":
            raise SinkError(
                f"table {table}: the batch's column {position} has an empty name, which "
                f"{database} cannot hold; give it a name where the data is made",
                transient=False,
            )
        key = name_key(name)
        if key in seen:
            raise SinkError(
                f"table {table}: {_same_column(seen[key], name, database)}; rename one of them",
                transient=False,
            )
        seen[key] = name


def _column_type(schema_field: pa.Field, *, table: str, database: str) -> ColumnType | None:
    """The column type of a batch column (``None``: all-null, no type yet).

    Raises:
        SinkError: permanent: its Arrow type has no column type.
    """
    try:
        return column_type(schema_field.type)
    except UnsupportedTypeError as err:
        raise SinkError(
            f"table {table}, column {schema_field.name!r}: {err}; {database} has no column "
            "type for it",
            transient=False,
        ) from err


def _plan_new_column(plan: SchemaPlan, name: str, incoming: ColumnType | None) -> None:
    """Plan a batch column the table does not have: in the table to create, or added; an
    all-null one is left out until a batch brings values."""
    if incoming is None:
        plan.targets[name] = None
        return
    plan.targets[name] = name
    if plan.create is not None:
        plan.create.append((name, incoming))
    else:
        plan.changes.append(ColumnChange("add", name, incoming))


def _retype(
    actual: str,
    current: ColumnType,
    incoming: ColumnType,
    values: pa.ChunkedArray,
    arrow_type: pa.DataType,
) -> ColumnChange | None:
    """The change table column ``actual`` of type ``current`` needs to take a batch column
    of type ``incoming``, if any."""
    if incoming.kind is Kind.STRING and current.length is not None:
        incoming = ColumnType(Kind.STRING, length=_longest(values))
    wanted = reconcile(current, incoming)
    if wanted is None:
        return ColumnChange("retype_if_empty", actual, incoming, current, arrow_type)
    if wanted != current:
        return ColumnChange("retype", actual, wanted, current, arrow_type)
    return None


def unreconcilable(table: str, change: ColumnChange, database: str, sql: str) -> SinkError:
    """The permanent error for a column whose values cannot take the batch's type."""
    return SinkError(
        f"table {table}, column {change.column!r}: the table has {sql} ({change.existing}), "
        f"the batch has {change.incoming} ({change.new}); {database} cannot hold both and the "
        "column already has values: write this column under another name, or alter it",
        transient=False,
    )


def _longest(values: pa.ChunkedArray) -> int:
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    longest = pc.max(pc.utf8_length(values)).as_py()
    return max(int(longest or 0), 1)


def _same_column(first: str, second: str, database: str) -> str:
    """Why two batch columns would be one column of the table."""
    if first == second:
        return f"the batch has two columns named {first!r}"
    why = (
        "SQLite compares column names without regard to ASCII case"
        if database == "SQLite"
        else "PostgreSQL keeps the first 63 bytes of a name"
    )
    return f"the batch's columns {first!r} and {second!r} are the same column in {database} ({why})"
