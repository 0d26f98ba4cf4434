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

    Raises:
        FormatError: two schemas cannot be reconciled (say, a string and an int column of
            the same name).
    """
    if not tables:
        return pa.table({})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
        raise FormatError(f"schemas cannot be unified: {err}", field="schema") from err
