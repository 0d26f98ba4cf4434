"""Which tables a sink may write, and how it writes each: append, or upsert by key. Pure.

A sink writes its own table (``table=``, ``--table``): batches that name no table go there,
and its progress is kept under that name. :class:`SinkTables` adds the tables batches may
name (:mod:`millpond.formats.routing`), each by name or by pattern, with its settings:

* ``append`` (the default): every row is added;
* ``upsert``: rows are merged by ``key`` (one or more columns); the last row of a key in
  queue order wins, and a row whose ``delete_column`` is true deletes its key. A table the
  sink creates gets a primary key on the key columns; an existing one needs a unique index on
  exactly them.

Patterns are ``fnmatch`` patterns (``*``, ``?``, ``[...]``) in the name part only
(``audit_*``, ``analytics.events_*``); the schema part of a pattern is a plain name. Names and
patterns are matched against the table the database resolves, not as typed: the sink
(:mod:`millpond.consumer.sinks._targets`) resolves them as it resolves its own table.

In a TOML file (``millpond consume --config sink.toml``)::

    [tables.orders]
    mode = "upsert"
    key = ["order_id"]
    delete_column = "deleted"   # optional

    [tables."analytics.customers"]  # a schema-qualified name is one quoted key
    mode = "upsert"
    key = ["region", "customer_id"]

    [tables."audit_*"]              # every table the pattern matches, appended
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from millpond.errors import ConfigError

__all__ = ["SinkTables", "TableMode", "TablePattern", "TableSettings", "load_tables"]

_PLAIN = r"[A-Za-z_][A-Za-z0-9_]*"
_WILD = r"[A-Za-z0-9_*?\[\]!-]+"
_PATTERN = re.compile(rf'^(?:(?P<schema>{_PLAIN}|"{_PLAIN}")\.)?(?P<name>{_WILD}|"{_PLAIN}")$')
_WILDCARDS = frozenset("*?[")
_SETTING_KEYS = frozenset({"mode", "key", "delete_column"})


class TableMode(StrEnum):
    """How a table takes its rows."""

    APPEND = "append"
    """Every row is added (the default)."""
    UPSERT = "upsert"
    """Rows are merged by key: the last row of a key in queue order wins; a delete marker
    deletes the key."""


@dataclass(frozen=True, slots=True)
class TableSettings:
    """How one table takes its rows."""

    mode: TableMode | str = TableMode.APPEND
    key: tuple[str, ...] = ()
    """``upsert``: the key columns (at least one)."""
    delete_column: str | None = None
    """``upsert``: a boolean column whose true rows delete their key (``None``: none). It is
    a marker, never a column of the table."""

    def __post_init__(self) -> None:
        """Raises:
        ConfigError: a mode other than ``append`` or ``upsert``; ``upsert`` without key
            columns; a key or delete column with ``append``; a key column named twice or an
            empty name; the delete column among the key columns.
        """
        try:
            object.__setattr__(self, "mode", TableMode(self.mode))
        except ValueError:
            raise ConfigError(
                "mode", f"expected 'append' or 'upsert', found {self.mode!r}"
            ) from None
        if isinstance(self.key, str):
            raise ConfigError("key", f"expected a list of column names, found {self.key!r}")
        object.__setattr__(self, "key", tuple(self.key))
        if self.mode is TableMode.APPEND:
            if self.key or self.delete_column is not None:
                raise ConfigError(
                    "key" if self.key else "delete_column",
                    "expected mode 'upsert' with a key or a delete column, found mode 'append'",
                )
            return
        if not self.key:
            raise ConfigError("key", "expected the key columns of an upsert, found none")
        for name in (*self.key, self.delete_column):
            if name is not None and (not isinstance(name, str) or not name):
                raise ConfigError("key", f"expected column names, found {name!r}")
        if len(set(self.key)) != len(self.key):
            raise ConfigError("key", f"expected each key column once, found {list(self.key)}")
        if self.delete_column is not None and self.delete_column in self.key:
            raise ConfigError(
                "delete_column",
                f"expected a column other than the key's, found {self.delete_column!r}",
            )

    @property
    def upsert(self) -> bool:
        return self.mode is TableMode.UPSERT

    def describe(self) -> str:
        """``append``, or ``upsert by (a, b) [deleting where d]``."""
        if not self.upsert:
            return "append"
        deleting = f", deleting where {self.delete_column}" if self.delete_column else ""
        return f"upsert by ({', '.join(self.key)}){deleting}"


APPEND = TableSettings()


@dataclass(frozen=True, slots=True)
class TablePattern:
    """A table name, or a pattern of names, as an allowed-tables entry gives it."""

    text: str
    """As given."""
    name: str
    """The name part, unquoted; may hold ``fnmatch`` wildcards."""
    schema: str | None
    """The schema part, unquoted (never a pattern), or ``None``."""

    @classmethod
    def parse(cls, key: str, text: str) -> TablePattern:
        """Raises:
        ConfigError: not ``name`` or ``schema.name`` (each part an identifier, bare or
            double-quoted; the name part may hold ``*``, ``?``, ``[...]`` when bare).
        """
        found = _PATTERN.match(text) if isinstance(text, str) else None
        if found is None:
            raise ConfigError(
                key,
                "expected a table name or pattern like 'orders', 'schema.orders' or "
                f"'events_*', found {text!r}",
            )
        schema = found.group("schema")
        return cls(
            text=text, name=found.group("name").strip('"'), schema=schema and schema.strip('"')
        )

    @property
    def wild(self) -> bool:
        """Whether the name part is a pattern (else it names one table)."""
        return bool(_WILDCARDS & set(self.name))


@dataclass(frozen=True)
class SinkTables:
    """The tables besides its own that a sink may write, and how it writes each.

    ``SinkTables({"orders": TableSettings("upsert", ("order_id",)), "audit_*": APPEND})``
    lets batches name ``orders`` (upserted by ``order_id``) and any table matching
    ``audit_*`` (appended). An exact name beats a pattern; among patterns the first that
    matches, in order, decides.
    """

    tables: Mapping[str, TableSettings] = field(default_factory=dict)
    """Names or patterns, with their settings, in order."""
    default: TableSettings = APPEND
    """The settings of the sink's own table (``table=``) unless ``tables`` names it."""
    rules: tuple[tuple[TablePattern, TableSettings], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Raises:
        ConfigError: a name that is not a table name or pattern, or settings that are not
            :class:`TableSettings`.
        """
        rules = []
        for text, settings in self.tables.items():
            if not isinstance(settings, TableSettings):
                raise ConfigError(
                    f"tables.{text}", f"expected TableSettings, found {type(settings).__name__}"
                )
            rules.append((TablePattern.parse(f"tables.{text}", text), settings))
        if not isinstance(self.default, TableSettings):
            raise ConfigError("default", "expected TableSettings")
        object.__setattr__(self, "rules", tuple(rules))

    @classmethod
    def allowing(cls, names: Iterable[str], *, default: TableSettings = APPEND) -> SinkTables:
        """Every table named or matched by ``names``, appended."""
        return cls({name: APPEND for name in names}, default=default)

    def merged(self, other: SinkTables) -> SinkTables:
        """These tables and ``other``'s after them (a name in both keeps these settings);
        ``other``'s default when it is not the plain append."""
        tables = dict(self.tables)
        for name, settings in other.tables.items():
            tables.setdefault(name, settings)
        default = other.default if other.default != APPEND else self.default
        return SinkTables(tables, default=default)


def load_tables(path: str | Path) -> SinkTables:
    """The ``[tables.NAME]`` sections of a TOML file (see the module docstring).

    Raises:
        ConfigError: the file cannot be read or is not TOML; an unknown key; settings that
            :class:`TableSettings` refuses (named ``tables.NAME.key``).
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as err:
        raise ConfigError("config", f"cannot read {where}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("config", f"{where} is not TOML: {err}") from None
    unknown = sorted(set(document) - {"tables"})
    if unknown:
        raise ConfigError(
            "config", f"{where}: expected only [tables.NAME] sections, found {unknown}"
        )
    sections = document.get("tables", {})
    if not isinstance(sections, dict):
        raise ConfigError("config", f"{where}: expected [tables.NAME] sections, found tables =")
    return SinkTables({name: _settings(where, name, body) for name, body in sections.items()})


def _settings(where: str, name: str, body: Any) -> TableSettings:
    if not isinstance(body, dict):
        raise ConfigError(f"tables.{name}", f"{where}: expected a [tables.{name}] section")
    unknown = sorted(set(body) - _SETTING_KEYS)
    if unknown:
        nested = [key for key in unknown if isinstance(body[key], dict)]
        hint = (
            f'; a schema-qualified name is one quoted key: [tables."{name}.{nested[0]}"]'
            if nested
            else ""
        )
        raise ConfigError(
            f"tables.{name}",
            f"{where}: expected mode, key and delete_column, found {unknown}{hint}",
        )
    key = body.get("key", [])
    if isinstance(key, str):
        key = [key]
    try:
        return TableSettings(
            mode=body.get("mode", "append"),
            key=tuple(key),
            delete_column=body.get("delete_column"),
        )
    except ConfigError as err:
        reason = str(err)[len(err.key) + 2 :]
        raise ConfigError(f"tables.{name}.{err.key}", f"{where}: {reason}") from None
