"""The tables one sink writes: which a batch may name, and each one's settings and state.

A sink keeps its progress under its own table (``table=``); batches may name others
(:mod:`millpond.formats.routing`), and :class:`Router` decides, by the name the database
resolves, whether a named table is one the sink may write (:class:`~millpond.consumer.sinks.
_tables.SinkTables`) and how. :class:`Target` is one such table as a connection knows it.

Matching is by the resolved name. An exact entry (``orders``) is resolved as the sink resolves
its own table, so ``public.orders`` and ``orders`` (PostgreSQL, ``search_path`` finding it in
``public``) or ``ORDERS`` and ``main.orders`` (SQLite) are the same entry. A pattern's name part
is matched as the database compares names (SQLite: ASCII case folded), and a table matches only
where the pattern's unqualified name (or its given schema) resolves to it: with
``search_path = app, public``, ``audit_*`` allows ``app.audit_1`` when ``audit_1`` resolves there,
and not ``public.audit_1`` behind it.

The sink's own bookkeeping tables (progress, quarantine, owners) are never a batch's table,
whatever a pattern says.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from fnmatch import fnmatchcase

from millpond.consumer.sinks._names import TableName
from millpond.consumer.sinks._tables import SinkTables, TableSettings
from millpond.consumer.sinks.base import SinkError
from millpond.consumer.sinks.types import ColumnType

__all__ = ["Router", "Target"]

Resolve = Callable[[TableName], TableName]


@dataclass(eq=False, slots=True)
class Target:
    """One table a sink writes, as one connection knows it."""

    table: TableName
    """As the database resolves it."""
    owners: TableName
    """The owners table next to it (resolved)."""
    settings: TableSettings
    columns: dict[str, ColumnType] | None = None
    """Its columns as last reflected (``None``: unknown); forgotten when a transaction fails."""
    merged: bool = False
    """Rows recorded under other spellings of it were moved on this connection (committed)."""
    key_checked: bool = False
    """Its unique index on the upsert key was found on this connection (committed)."""
    owners_ready: bool = False
    """Its owners table is known to exist on this connection (committed)."""
    owned_by: str | None = None
    """The queue a committed transaction on this connection found or made its owner: a table
    the queue owns stays its own (another queue's claim never replaces it), so later writes of
    that queue need not ask again."""


class Router:
    """Which tables a sink may write, resolved on one connection."""

    def __init__(
        self,
        tables: SinkTables,
        *,
        home: TableName,
        resolve: Resolve,
        name_key: Callable[[str], str],
        reserved: Collection[str],
    ) -> None:
        """Resolve every exact entry of ``tables``.

        Args:
            tables: what the sink was configured with.
            home: the sink's own table, resolved.
            resolve: resolves a name as the database does (on the current connection).
            name_key: how the database compares names.
            reserved: names (as ``name_key`` gives them) no batch may name.

        Raises:
            SinkError: two entries name one table with different settings, or an entry names
                a table the sink keeps itself (permanent).
        """
        self._home = home
        self._name_key = name_key
        self._reserved = frozenset(reserved)
        self._default = tables.default
        self._exact: dict[TableName, tuple[str, TableSettings]] = {}
        self._patterns = [(p, s) for p, s in tables.rules if p.wild]
        for pattern, settings in tables.rules:
            if pattern.wild:
                continue
            table = resolve(TableName(pattern.name, pattern.schema))
            if name_key(table.name) in self._reserved:
                raise SinkError(
                    f"table {pattern.text}: the sink keeps its own records there; no batch may "
                    "write into it",
                    transient=False,
                )
            earlier = self._exact.get(table)
            if earlier is not None and earlier[1] != settings:
                raise SinkError(
                    f"tables {earlier[0]} and {pattern.text} are one table ({table}) with two "
                    f"settings ({earlier[1].describe()}, {settings.describe()}); name it once",
                    transient=False,
                )
            self._exact.setdefault(table, (pattern.text, settings))
        self._entries = [pattern.text for pattern, _ in tables.rules]

    def settings(self, table: TableName, resolve: Resolve) -> TableSettings | None:
        """How ``table`` (resolved) is written, or ``None`` when no batch may write it."""
        exact = self._exact.get(table)
        if exact is not None:
            return exact[1]
        if table == self._home:
            return self._default
        key = self._name_key(table.name)
        if key in self._reserved:
            return None
        for pattern, settings in self._patterns:
            if fnmatchcase(key, self._name_key(pattern.name)) and (
                resolve(TableName(table.name, pattern.schema)) == table
            ):
                return settings
        return None

    def exact(self) -> list[TableName]:
        """The sink's own table and every table named exactly."""
        return [self._home, *(table for table in self._exact if table != self._home)]

    def describe(self) -> str:
        """What may be written, for messages: ``events (its own), orders, audit_*``."""
        return ", ".join([f"{self._home} (its own)", *self._entries])
