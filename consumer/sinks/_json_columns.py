"""Nested Arrow columns as JSON text, a column at a time.

The per-value writer in :mod:`millpond.consumer.sinks._values` turns each row into Python
objects and back into text: about 30 µs a row for an array, a map and a struct of two fields,
the whole of a consumer's time on such a table (Spark -> PostgreSQL at 16,000 rows/s against
45,000 for Spark's own JDBC writer). Here Arrow's compute kernels build the same text for
every row of a column at once: leaves become JSON scalars column-wise (numbers by a cast,
strings quoted and escaped by substring replacement), and structs, lists and maps are joined
from their children's text. Floats, binary, decimals in scientific notation and variants are
leaves written value by value by the functions the writer uses (``scalar_json``,
``variant_json``), so the two cannot differ; ``tests/consumer/test_json_text.py`` checks that
both write the same text for every type and value.

:func:`columnar` says which types this module takes; the rest (float16, nanosecond times,
month-day-nano intervals, list views, a struct with two fields of one name, ...) go through
the writer.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._json import quoted_strings, scalar_json
from millpond.consumer.sinks._variant import is_variant
from millpond.consumer.sinks._variant_columns import variants_json

__all__ = ["columnar", "json_column", "plain_scalar"]

# Not pa.scalar(None, ...): that imports pandas (0.4 s) in every process importing the sinks.
_NULL_TEXT = pa.nulls(1, pa.string())[0]
_SUB_MICROSECOND = ("ns",)


def columnar(dtype: pa.DataType) -> bool:
    """Whether :func:`json_column` writes every value of ``dtype`` (else use the writer)."""
    t = pa.types
    if is_variant(dtype):
        return True
    if t.is_dictionary(dtype):
        return columnar(dtype.value_type)
    if t.is_struct(dtype):
        names = [dtype.field(i).name for i in range(dtype.num_fields)]
        return len(set(names)) == len(names) and all(
            columnar(dtype.field(i).type) for i in range(dtype.num_fields)
        )
    if t.is_map(dtype):
        return columnar(dtype.key_type) and columnar(dtype.item_type)
    if t.is_list(dtype) or t.is_large_list(dtype) or t.is_fixed_size_list(dtype):
        return columnar(dtype.value_type)
    if t.is_timestamp(dtype) or t.is_time(dtype) or t.is_duration(dtype):
        return dtype.unit not in _SUB_MICROSECOND
    return plain_scalar(dtype) or t.is_decimal(dtype) or t.is_date(dtype)


def plain_scalar(dtype: pa.DataType) -> bool:
    """Null, boolean, integer, float32/64, string or binary: a JSON scalar however written."""
    t = pa.types
    return bool(
        t.is_null(dtype)
        or t.is_boolean(dtype)
        or t.is_integer(dtype)
        or t.is_float32(dtype)
        or t.is_float64(dtype)
        or t.is_string(dtype)
        or t.is_large_string(dtype)
        or t.is_binary(dtype)
        or t.is_large_binary(dtype)
        or t.is_fixed_size_binary(dtype)
    )


def json_column(values: pa.Array) -> pa.Array:
    """Each value of ``values`` (a type :func:`columnar` takes) as JSON text; NULL stays
    NULL."""
    t = pa.types
    dtype = values.type
    if t.is_null(dtype):
        return pa.nulls(len(values), pa.string())
    if is_variant(dtype):
        return variants_json(values)
    if t.is_dictionary(dtype):
        return json_column(values.dictionary_decode())
    if t.is_struct(dtype):
        return _struct(values)
    if t.is_map(dtype):
        return _map(values)
    if t.is_fixed_size_list(dtype):
        return _list(pc.cast(values, pa.list_(dtype.value_type)))
    if t.is_list(dtype) or t.is_large_list(dtype):
        return _list(values)
    return _leaf(values)


def _leaf(values: pa.Array) -> pa.Array:
    t = pa.types
    dtype = values.type
    if t.is_boolean(dtype):
        return pc.if_else(values, "true", "false")
    if t.is_integer(dtype):
        return pc.cast(values, pa.string())
    if t.is_decimal(dtype):
        return _decimal(values)
    if t.is_string(dtype) or t.is_large_string(dtype):
        return quoted_strings(pc.cast(values, pa.string()))
    if t.is_date(dtype):
        return quoted_strings(pc.cast(pc.cast(values, pa.date32()), pa.string()))
    if t.is_time(dtype):
        return quoted_strings(pc.cast(pc.cast(values, pa.time64("us")), pa.string()))
    if t.is_timestamp(dtype):
        return quoted_strings(_timestamp(values))
    if t.is_duration(dtype):
        return pc.cast(pc.cast(pc.cast(values, pa.duration("us")), pa.int64()), pa.string())
    # Floats (Python's repr, NaN and ±Infinity as strings) and binary (base64), value by value.
    return _per_value(values, scalar_json)


def _per_value(values: pa.Array, write: Any) -> pa.Array:
    return pa.array([None if v is None else write(v) for v in values.to_pylist()], pa.string())


def _decimal(values: pa.Array) -> pa.Array:
    text = pc.cast(values, pa.string())
    if not pc.any(pc.match_substring(text, "E")).as_py():
        return text
    # Arrow writes some decimals in scientific notation ('1.23E+4'); JSON has them plain.
    return _per_value(values, scalar_json)


def _timestamp(values: pa.Array) -> pa.Array:
    utc = values.type.tz is not None
    us = pc.cast(values, pa.timestamp("us", tz="UTC") if utc else pa.timestamp("us"))
    text = pc.strftime(us, format="%Y-%m-%dT%H:%M:%S")
    if utc:
        text = pc.binary_join_element_wise(text, "+00:00", "")
    return text


def _struct(values: pa.StructArray) -> pa.Array:
    dtype = values.type
    if dtype.num_fields == 0:
        return _valid_only(pa.array(["{}"] * len(values), pa.string()), values)
    parts: list[Any] = []
    for index in range(dtype.num_fields):
        name = json.dumps(dtype.field(index).name, ensure_ascii=False)
        parts.append(("{" if index == 0 else ",") + name + ":")
        parts.append(_filled(json_column(values.field(index))))
    return _valid_only(pc.binary_join_element_wise(*parts, "}", ""), values)


def _list(values: pa.Array) -> pa.Array:
    items, offsets = _children(values)
    lists = _rebuild(offsets, _filled(json_column(items)))
    text = pc.binary_join_element_wise("[", pc.binary_join(lists, ","), "]", "")
    return _valid_only(text, values)


def _map(values: pa.MapArray) -> pa.Array:
    entries, offsets = _children(values)
    keys = json_column(entries.field(0))
    # A key is the text of its JSON scalar: a string as it is, anything else quoted.
    keys = pc.if_else(
        pc.starts_with(keys, '"'), keys, pc.binary_join_element_wise('"', keys, '"', "")
    )
    pairs = pc.binary_join_element_wise(keys, ":", _filled(json_column(entries.field(1))), "")
    text = pc.binary_join_element_wise("{", pc.binary_join(_rebuild(offsets, pairs), ","), "}", "")
    return _valid_only(text, values)


def _children(values: Any) -> tuple[pa.Array, pa.Array]:
    """A list or map array's items (those its rows reach) and its offsets from 0."""
    offsets = values.offsets
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    return values.values.slice(start, end - start), pc.subtract(offsets, start)


def _rebuild(offsets: pa.Array, items: pa.Array) -> pa.Array:
    if offsets.type == pa.int64():
        return pa.LargeListArray.from_arrays(offsets, items)
    return pa.ListArray.from_arrays(offsets, items)


def _filled(text: pa.Array) -> pa.Array:
    return pc.fill_null(text, "null") if text.null_count else text


def _valid_only(text: pa.Array, values: pa.Array) -> pa.Array:
    if not values.null_count:
        return text
    return pc.if_else(values.is_valid(), text, _NULL_TEXT)
