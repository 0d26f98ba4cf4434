"""Which table a metadata item's entries go to: the ``millpond.table`` line of its payload.

A manifest metadata item carries opaque payload bytes (RFC 0001). Millpond reserves payloads
that begin with ``millpond.`` and defines one such line::

    millpond.table=<name>\\n<the application's own payload, unchanged>

``<name>`` is UTF-8, ``table`` or ``schema.table``, each part ``[A-Za-z_][A-Za-z0-9_]*`` bare or
double-quoted (what ``millpond consume --table`` takes). The line ends at the first ``\\n``; a
payload that is only ``millpond.table=<name>`` (no newline) names the table and carries nothing
else. A payload that does not begin with ``millpond.table=`` names no table: the consumer writes
its entries into its default table, as before. Any writer (an RFC peer in Rust or Go too) routes
entries by putting the line in front of its payload; readers that do not know it see an opaque
payload.

An item names one table. Its entries are the records from its ``start_index`` up to the next
item's, so the items of one batch may name different tables (a producer's batch holds several
``produce()`` calls): the consumer writes each item's rows into that item's table, all in the
batch's one transaction. A payload with a second ``millpond.table=`` line right after the
first is refused (:class:`~millpond.errors.FormatError`): which one was meant cannot be told,
so the consumer treats the batch as a bad batch.
"""

from __future__ import annotations

import re

from millpond.errors import FormatError, InvalidInputError

__all__ = ["TABLE_PREFIX", "split_table", "with_table"]

TABLE_PREFIX = b"millpond.table="
"""The start of a payload that names its entries' table."""

_PART = r'(?:[A-Za-z_][A-Za-z0-9_]*|"[A-Za-z_][A-Za-z0-9_]*")'
_NAME = re.compile(rf"^{_PART}(?:\.{_PART})?$")
_MAX_NAME = 300  # characters: two quoted parts of PostgreSQL's 63 bytes fit with room to spare


def _check(name: str) -> str | None:
    """Why ``name`` is not a table name, or ``None`` when it is one."""
    if not name:
        return "an empty table name"
    if len(name) > _MAX_NAME:
        return f"a table name of {len(name)} characters (at most {_MAX_NAME})"
    if not _NAME.match(name):
        return (
            f"{name!r}, which is not a table name like 'orders', 'schema.orders' or "
            '\'"schema"."orders"\''
        )
    return None


def with_table(payload: bytes, table: str) -> bytes:
    """``payload`` naming ``table`` as its entries' table.

    Raises:
        InvalidInputError: ``table`` is not a table name, or ``payload`` already names one.
    """
    problem = _check(table) if isinstance(table, str) else f"a {type(table).__name__}"
    if problem is not None:
        raise InvalidInputError(f"table: expected a table name, found {problem}")
    if payload.startswith(TABLE_PREFIX):
        raise InvalidInputError(
            "table: the metadata already names a table (it begins with 'millpond.table='); "
            "name it once"
        )
    return TABLE_PREFIX + table.encode() + b"\n" + payload


def split_table(payload: bytes, *, name: str = "metadata") -> tuple[str | None, bytes]:
    """The table ``payload`` names (``None``: none) and the application's payload after it.

    Raises:
        FormatError: the line does not hold a table name, or a second one follows it.
    """
    if not payload.startswith(TABLE_PREFIX):
        return None, payload
    start = len(TABLE_PREFIX)
    end = payload.find(b"\n", start)
    raw, rest = (payload[start:], b"") if end < 0 else (payload[start:end], payload[end + 1 :])
    try:
        table = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(
            f"{name}: the millpond.table line is not UTF-8", field="metadata"
        ) from None
    problem = _check(table)
    if problem is not None:
        raise FormatError(f"{name}: the millpond.table line names {problem}", field="metadata")
    if rest.startswith(TABLE_PREFIX):
        raise FormatError(
            f"{name}: two millpond.table lines in one metadata item ({table!r} and another); "
            "an item names one table",
            field="metadata",
        )
    return table, rest
