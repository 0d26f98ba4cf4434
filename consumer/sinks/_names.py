"""SQL names both ADBC sinks share: quoted identifiers, ``[schema.]table`` names, and which
spellings name one table.

A table is keyed in the progress and owners tables by the name the database resolves, never by
the name as typed: ``events``, ``EVENTS`` and ``main.events`` are one SQLite table, ``kill3``
and ``public.kill3`` one PostgreSQL table (``search_path`` decides where an unqualified name
lives), and each must find the same progress and the same owner. The sink writes every part of
a name double-quoted, so on PostgreSQL a part is taken exactly as written (``Events`` is the
table ``"Events"``, as it always was); SQLite folds ASCII case even inside quotes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from millpond.consumer.sinks._schema import ascii_casefold
from millpond.consumer.sinks.base import SinkError
from millpond.errors import ConfigError

__all__ = ["TableName", "quote", "same_table", "spellings_sql", "sqlite_table"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUOTED = re.compile(r'^"([A-Za-z_][A-Za-z0-9_]*)"$')


def quote(identifier: str) -> str:
    """A double-quoted SQL identifier (PostgreSQL and SQLite agree on this)."""
    if "\x00" in identifier:
        raise SinkError(f"identifier {identifier!r} contains a NUL byte", transient=False)
    return '"' + identifier.replace('"', '""') + '"'


@dataclass(frozen=True, slots=True)
class TableName:
    """``[schema.]table``; both parts plain identifiers."""

    name: str
    schema: str | None = None

    @classmethod
    def parse(cls, key: str, value: str) -> TableName:
        """Parse ``table`` or ``schema.table``, each part bare or double-quoted (``"table"``
        is ``table``: the sink quotes every part it writes).

        Raises:
            ConfigError: a part that is not ``[A-Za-z_][A-Za-z0-9_]*``, bare or quoted.
        """
        parts = value.split(".") if isinstance(value, str) else []
        names = [_part(part) for part in parts]
        if not 1 <= len(parts) <= 2 or not all(names):
            raise ConfigError(
                key,
                "expected a table name like 'rows', 'schema.rows' or '\"schema\".\"rows\"', "
                f"found {value!r}",
            )
        return cls(name=str(names[-1]), schema=names[0] if len(names) == 2 else None)

    def sibling(self, suffix: str) -> TableName:
        """A table in the same schema named after this one (``progress`` -> ``progress_x``)."""
        return TableName(name=f"{self.name}{suffix}", schema=self.schema)

    @property
    def sql(self) -> str:
        return f"{quote(self.schema)}.{quote(self.name)}" if self.schema else quote(self.name)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name


def _part(part: str) -> str | None:
    if _IDENTIFIER.match(part):
        return part
    quoted = _QUOTED.match(part)
    return quoted.group(1) if quoted else None


def sqlite_table(table: TableName) -> TableName:
    """The table as SQLite resolves it: ASCII case folded (SQLite ignores it, quoted or not),
    and ``main.`` dropped (an unqualified name is looked up in ``main``: the sink attaches no
    other database)."""
    schema = ascii_casefold(table.schema) if table.schema is not None else None
    return TableName(name=ascii_casefold(table.name), schema=None if schema == "main" else schema)


def spellings_sql(table: TableName) -> str:
    """The distinct ``target_table`` values of a progress-shaped table, one index probe each
    (a loose index scan over its primary key, however many rows it holds)."""
    return (
        "WITH RECURSIVE spelled(t) AS (SELECT min(target_table) FROM "
        f"{table.sql} UNION ALL SELECT (SELECT min(target_table) FROM {table.sql} "
        "WHERE target_table > spelled.t) FROM spelled WHERE spelled.t IS NOT NULL) "
        "SELECT t FROM spelled WHERE t IS NOT NULL"
    )


def same_table(
    recorded: Iterable[Any],
    table: TableName,
    *,
    resolve: Callable[[TableName], TableName],
    name_key: Callable[[str], str],
) -> list[str]:
    """The spellings among ``recorded`` (``target_table`` values) other than ``str(table)``
    that name ``table`` (resolved), in sorted order.

    Earlier versions keyed progress and owners by the name as typed: those rows are this
    table's if their spelling resolves to it. A value that is not a table name is nobody's.

    Args:
        recorded: ``target_table`` values found.
        table: the resolved table.
        resolve: resolves a parsed spelling as the database would now.
        name_key: how the database compares names (only spellings whose name matches are
            resolved: on PostgreSQL that asks the catalog).
    """
    key = str(table)
    found: set[str] = set()
    for value in {str(v) for v in recorded if v is not None} - {key}:
        try:
            spelled = TableName.parse("target_table", value)
        except ConfigError:
            continue
        if name_key(spelled.name) == name_key(table.name) and resolve(spelled) == table:
            found.add(value)
    return sorted(found)
