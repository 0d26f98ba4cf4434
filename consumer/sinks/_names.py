"""SQL names both ADBC sinks share: quoted identifiers and ``[schema.]table`` names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from millpond.consumer.sinks.base import SinkError
from millpond.errors import ConfigError

__all__ = ["TableName", "quote"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
        """Parse ``table`` or ``schema.table``.

        Raises:
            ConfigError: a part that is not ``[A-Za-z_][A-Za-z0-9_]*``.
        """
        parts = value.split(".") if isinstance(value, str) else []
        if not 1 <= len(parts) <= 2 or not all(_IDENTIFIER.match(part) for part in parts):
            raise ConfigError(
                key, f"expected a table name like 'rows' or 'schema.rows', found {value!r}"
            )
        return cls(name=parts[-1], schema=parts[0] if len(parts) == 2 else None)

    def sibling(self, suffix: str) -> TableName:
        """A table in the same schema named after this one (``progress`` -> ``progress_x``)."""
        return TableName(name=f"{self.name}{suffix}", schema=self.schema)

    @property
    def sql(self) -> str:
        return f"{quote(self.schema)}.{quote(self.name)}" if self.schema else quote(self.name)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}" if self.schema else self.name
