"""Arrow helpers: one IPC stream per record batch, and the "representative schema".

Entries made by ``produce_arrow`` are Arrow IPC *stream* bytes holding one record batch each.
When schemas drift between batches (a column added, an int widened), reading them back gives
one table over the superset of columns, each with the widest type seen, and nulls where a
batch lacked a column.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyarrow as pa

from millpond.errors import FormatError, InvalidInputError

__all__ = ["decode_ipc", "encode_ipc", "unify_tables"]


def encode_ipc(data: pa.RecordBatch | pa.Table) -> list[bytes]:
    """One IPC stream per non-empty record batch of ``data`` (a table may hold several).

    Raises:
        InvalidInputError: ``data`` is not a record batch or table.
    """
    if isinstance(data, pa.Table):
        batches: Iterable[pa.RecordBatch] = data.to_batches()
    elif isinstance(data, pa.RecordBatch):
        batches = [data]
    else:
        raise InvalidInputError(
            f"data: expected a pyarrow RecordBatch or Table, found {type(data).__name__}"
        )
    out: list[bytes] = []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        out.append(sink.getvalue().to_pybytes())
    return out


def decode_ipc(data: bytes | memoryview, *, name: str = "entry") -> pa.Table:
    """Read one IPC stream back into a table.

    Raises:
        FormatError: the bytes are not an Arrow IPC stream.
    """
    try:
        with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
            return reader.read_all()
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as err:
        raise FormatError(f"{name}: not an Arrow IPC stream: {err}", field="entry") from err


def unify_tables(tables: Sequence[pa.Table]) -> pa.Table:
    """Concatenate tables whose schemas drifted: superset of columns, widest types, nulls.

    A column that is all-null (Arrow ``null`` type) in some tables takes the type the others
    give it. Time-zone-aware timestamps are instants whatever their zone is called
    (``Etc/UTC``, ``UTC``, ``America/New_York``): they are unified under the zone of the first
    table that has one, which changes no value.

    Raises:
        FormatError: two schemas cannot be reconciled (say, a string and an int column of
            the same name).
    """
    if not tables:
        return pa.table({})
    tables = _same_zones(tables)
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
        raise FormatError(f"schemas cannot be unified: {err}", field="schema") from err


def _same_zones(tables: Sequence[pa.Table]) -> Sequence[pa.Table]:
    zones: dict[str, str] = {}
    for table in tables:
        for field in table.schema:
            if pa.types.is_timestamp(field.type) and field.type.tz is not None:
                zones.setdefault(field.name, field.type.tz)
    if not zones:
        return tables
    out: list[pa.Table] = []
    for table in tables:
        for index, field in enumerate(table.schema):
            zone = zones.get(field.name)
            dtype = field.type
            if zone is not None and pa.types.is_timestamp(dtype) and dtype.tz not in (None, zone):
                wanted = pa.timestamp(dtype.unit, tz=zone)
                table = table.set_column(
                    index, field.with_type(wanted), table.column(index).cast(wanted)
                )
        out.append(table)
    return out
