"""Batch values rewritten for a column: what each kind becomes in PostgreSQL and in SQLite.

Pure functions over Arrow arrays; the mapping they implement is the table in
:mod:`millpond.consumer.sinks.types` (and the docs' types page).

Nested values (arrays, maps, structs) become JSON text in both databases, written the way
Spark's ``to_json`` writes them: a struct is an object with its fields in order, a map is an
object whose keys are the map keys as text, a list is an array. Inside JSON, decimals are
exact numbers, floats are numbers except NaN and ±Infinity (the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"``), binary is base64, dates and times are ISO-8601 text
(instants in UTC with ``+00:00``), intervals are integer microseconds. A Spark ``VARIANT``
becomes the JSON it holds (:mod:`millpond.consumer.sinks._variant`), not its binary encoding.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._json import plain_json, scalar_json
from millpond.consumer.sinks._json_columns import columnar, json_column, plain_scalar
from millpond.consumer.sinks._variant import is_variant, variant_json
from millpond.consumer.sinks.types import ColumnType, Kind

__all__ = ["decimal_text", "for_postgres", "for_sqlite", "json_text"]


def for_postgres(values: pa.ChunkedArray, column: ColumnType) -> pa.ChunkedArray:
    """Values in the Arrow type binary COPY needs for a column of type ``column``.

    Raises:
        pa.ArrowInvalid: a value the column cannot hold (the sink names table and column).
    """
    target = _postgres_arrow(column)
    if column.kind is Kind.JSON and not pa.types.is_string(values.type):
        return json_text(values)
    if target is None:
        return values
    if pa.types.is_null(values.type):
        return pa.chunked_array([pa.nulls(len(values), target)], target)
    values = _cast(values, target)
    if pa.types.is_string(target):
        _refuse_nul(values)
    return values


def _refuse_nul(values: pa.ChunkedArray) -> None:
    """PostgreSQL text cannot hold U+0000; say which row has one instead of COPY's
    'invalid byte sequence for encoding "UTF8": 0x00'."""
    has_nul = pc.fill_null(pc.match_substring(values, "\x00"), False)
    if not pc.any(has_nul).as_py():
        return
    rows = pc.indices_nonzero(has_nul).to_pylist()
    raise pa.ArrowInvalid(
        f"{len(rows)} row(s) hold a NUL character (U+0000), which PostgreSQL text cannot "
        f"store, first at row {rows[0]} of the batch; remove it where the data is made "
        "(Spark: regexp_replace(col, '\\\\x00', '')); this batch can only be set aside "
        "(millpond quarantine)"
    )


def for_sqlite(values: pa.ChunkedArray, column: ColumnType) -> tuple[pa.ChunkedArray, list[int]]:
    """Values as the driver must bind them for a SQLite column of type ``column``.

    Returns:
        The values, and the row positions holding a NaN float: SQLite stores a NaN real as
        NULL, so the sink writes those rows' value as the text ``'NaN'`` afterwards.
    """
    kind = column.kind
    if pa.types.is_null(values.type):
        return values, []
    if pa.types.is_dictionary(values.type):
        values = _cast(values, values.type.value_type)
    incoming = values.type
    t = pa.types
    if t.is_floating(incoming):
        values = _cast(values, pa.float64())
        nans = pc.indices_nonzero(pc.fill_null(pc.is_nan(values), False)).to_pylist()
        return values, nans
    if t.is_decimal(incoming) or (kind is Kind.DECIMAL and t.is_integer(incoming)):
        return decimal_text(values), []
    if t.is_boolean(incoming) or t.is_integer(incoming):
        return _cast(values, pa.int64()), []
    if t.is_timestamp(incoming):
        return _timestamp_text(values, utc=incoming.tz is not None), []
    if t.is_date(incoming):
        return _cast(_cast(values, pa.date32()), pa.string()), []
    if t.is_time(incoming):
        return _cast(_cast(values, pa.time64("us")), pa.string()), []
    if t.is_duration(incoming):
        return _cast(_cast(values, pa.duration("us")), pa.int64()), []
    if t.is_large_string(incoming) or t.is_string_view(incoming):
        return _cast(values, pa.string()), []
    if (
        t.is_large_binary(incoming)
        or t.is_fixed_size_binary(incoming)
        or t.is_binary_view(incoming)
    ):
        return _cast(values, pa.binary()), []
    if t.is_nested(incoming):
        return json_text(values), []
    return values, []


def decimal_text(values: pa.ChunkedArray) -> pa.ChunkedArray:
    """Exact decimals (or integers) as plain-notation text: ``'12300'``, ``'-0.01'``."""
    text = _cast(values, pa.string())
    if pa.types.is_integer(values.type) or not pc.any(pc.match_substring(text, "E")).as_py():
        return text
    # Arrow writes some decimals in scientific notation ('1.23E+4', '1E-10').
    plain = [None if v is None else format(v, "f") for v in values.to_pylist()]
    return pa.chunked_array([pa.array(plain, pa.string())], pa.string())


def json_text(values: pa.ChunkedArray) -> pa.ChunkedArray:
    """Nested values as JSON text, one document per row (NULL stays NULL).

    Most types are written a column at a time (:mod:`millpond.consumer.sinks._json_columns`).
    The rest (float16, nanosecond times, month-day-nano intervals, list views, a struct with
    two fields of one name) go row by row: through the standard library's C encoder where it
    writes what the writer below writes, else the writer. All three write the same text
    (``tests/consumer/test_json_text.py``).
    """
    dtype = values.type
    if columnar(dtype):
        chunks = [json_column(chunk) for chunk in values.chunks]
        return pa.chunked_array(chunks, pa.string())
    write = _encode if _encodable(dtype) else _dumps
    out = [None if value is None else write(value, dtype) for value in values.to_pylist()]
    return pa.chunked_array([pa.array(out, pa.string())], pa.string())


# -- helpers -------------------------------------------------------------------------------------


def _postgres_arrow(column: ColumnType) -> pa.DataType | None:
    kind = column.kind
    if kind is Kind.DECIMAL:
        assert column.precision is not None
        assert column.scale is not None
        if column.precision <= 38:
            return pa.decimal128(column.precision, column.scale)
        return pa.decimal256(min(column.precision, 76), column.scale)
    return _POSTGRES_ARROW.get(kind)


_POSTGRES_ARROW: dict[Kind, pa.DataType] = {
    Kind.BOOLEAN: pa.bool_(),
    Kind.INT16: pa.int16(),
    Kind.INT32: pa.int32(),
    Kind.INT64: pa.int64(),
    Kind.FLOAT32: pa.float32(),
    Kind.FLOAT64: pa.float64(),
    Kind.STRING: pa.string(),
    Kind.BINARY: pa.binary(),
    Kind.DATE: pa.date32(),
    Kind.TIME: pa.time64("us"),
    # PostgreSQL keeps microseconds: nanoseconds are cut, as PostgreSQL itself would.
    Kind.TIMESTAMP: pa.timestamp("us"),
    Kind.INSTANT: pa.timestamp("us", tz="UTC"),
    Kind.INTERVAL: pa.duration("us"),
}


def _cast(values: pa.ChunkedArray, target: pa.DataType) -> pa.ChunkedArray:
    if values.type == target:
        return values
    # Temporal casts to a coarser unit truncate (PostgreSQL keeps microseconds); every other
    # cast must be exact, or it raises and the sink names the column.
    safe = not (pa.types.is_temporal(values.type) and pa.types.is_temporal(target))
    return pc.cast(values, target, safe=safe)


def _timestamp_text(values: pa.ChunkedArray, *, utc: bool) -> pa.ChunkedArray:
    us = _cast(values, pa.timestamp("us", tz="UTC") if utc else pa.timestamp("us"))
    text = pc.strftime(us, format="%Y-%m-%dT%H:%M:%S")
    if utc:
        text = pc.binary_join_element_wise(text, pa.scalar("+00:00"), "")
    return _cast(text, pa.string())


def _encodable(dtype: pa.DataType) -> bool:
    """Whether the C encoder writes what :func:`_write` writes for every value of ``dtype``
    (except a float that is not finite, which it refuses)."""
    t = pa.types
    if t.is_struct(dtype):
        names = [dtype.field(i).name for i in range(dtype.num_fields)]
        return (
            not is_variant(dtype)
            and len(set(names)) == len(names)  # a dict keeps one of two equal names
            and all(_encodable(dtype.field(i).type) for i in range(dtype.num_fields))
        )
    if t.is_list(dtype) or t.is_large_list(dtype) or t.is_fixed_size_list(dtype):
        return _encodable(dtype.value_type)
    return bool(
        plain_scalar(dtype)
        or t.is_timestamp(dtype)
        or t.is_date(dtype)
        or t.is_time(dtype)
        or t.is_duration(dtype)
    )


_ENCODER = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=plain_json
)
"""Writes binary, dates, times and durations as :func:`plain_json` says, as the writer does."""


def _encode(value: Any, dtype: pa.DataType) -> str:
    try:
        return _ENCODER.encode(value)
    except ValueError:  # NaN or ±Infinity: strings in our JSON, which only the writer knows
        return _dumps(value, dtype)


def _dumps(value: Any, dtype: pa.DataType) -> str:
    parts: list[str] = []
    _write(value, dtype, parts)
    return "".join(parts)


def _write(value: Any, dtype: pa.DataType, out: list[str]) -> None:
    t = pa.types
    if value is None:
        out.append("null")
    elif is_variant(dtype):
        out.append(variant_json(value["value"], value["metadata"]))
    elif t.is_dictionary(dtype):
        _write(value, dtype.value_type, out)
    elif t.is_struct(dtype):
        out.append("{")
        for index in range(dtype.num_fields):
            field = dtype.field(index)
            if index:
                out.append(",")
            out.append(json.dumps(field.name, ensure_ascii=False))
            out.append(":")
            _write(value.get(field.name), field.type, out)
        out.append("}")
    elif t.is_map(dtype):
        out.append("{")
        for index, (key, item) in enumerate(value):
            if index:
                out.append(",")
            out.append(json.dumps(_key_text(key, dtype.key_type), ensure_ascii=False))
            out.append(":")
            _write(item, dtype.item_type, out)
        out.append("}")
    elif (
        t.is_list(dtype)
        or t.is_large_list(dtype)
        or t.is_fixed_size_list(dtype)
        or (t.is_list_view(dtype) or t.is_large_list_view(dtype))
    ):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, dtype.value_type, out)
        out.append("]")
    else:
        out.append(scalar_json(value, dtype))


def _key_text(key: Any, dtype: pa.DataType) -> str:
    text = scalar_json(key, dtype)
    return json.loads(text) if text.startswith('"') else text
