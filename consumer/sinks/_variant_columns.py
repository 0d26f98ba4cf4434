"""Spark ``VARIANT`` columns as JSON text, many rows at once.

Decoding a variant in Python costs about 4 µs a row (:func:`~millpond.consumer.sinks._variant.
variant_json`), most of a consumer's work on a table with a variant column. The rows of one
column mostly share a layout: the same keys, the same shape, integers of the same width and
strings of the same length, so the same bytes everywhere but in those integers and strings.
Rows are grouped by their key dictionary and their length; the first row of a group is traced
into a template (literal text, and where its integers, floats and short strings lie), every row
of the group whose other bytes equal the template's is written from it with Arrow kernels (the
floats by Python's repr, value by value), and the rest (another layout, a decimal, a date, a
long string, anything the tracer does not take, a group under 64 rows) row by row as before.
The bytes a parse reads to find its way (headers, counts, field ids, offsets) are all
compared, so a row that matches decodes along the template's path: the text is the per-row
decoder's (``tests/consumer/test_variant.py`` checks that it is).
"""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.consumer.sinks._json import quoted_strings, scalar_json
from millpond.consumer.sinks._variant import (
    _ARRAY,
    _INTS,
    _LITERALS,
    _OBJECT,
    _PRIMITIVE,
    _SHORT_STRING,
    json_keys,
    variant_json,
)

__all__ = ["variants_json"]

# Rows: a group of fewer is decoded row by row. A template costs a few dozen kernel calls
# (about 0.3 ms), what 64 rows cost row by row.
_SMALL_GROUP = 64
_TEMPLATES_PER_GROUP = 8  # then the rows left of a group go row by row
_INT_ARROW = {1: pa.int8(), 2: pa.int16(), 4: pa.int32(), 8: pa.int64()}  # by width in bytes
_INT_TYPES = {type_id: (size, _INT_ARROW[size]) for type_id, size in _INTS.items()}
_FLOAT_TYPES = {7: (8, pa.float64()), 14: (4, pa.float32())}
_NO_GROUP = -1


class _Unsupported(Exception):
    """The traced row holds something a template does not take."""


def variants_json(values: pa.StructArray) -> pa.Array:
    """Each variant of ``values`` (Spark's ``struct<value, metadata>``) as JSON text; NULL
    stays NULL.

    Raises:
        FormatError: a variant the decoder cannot read (as :func:`variant_json` raises it).
    """
    data = pc.fill_null(values.field(0), b"")
    dictionaries = pc.dictionary_encode(pc.fill_null(values.field(1), b""))
    # A group: one key dictionary and one length (a layout can only be shared within one).
    group = pc.add(
        pc.multiply(pc.cast(dictionaries.indices, pa.int64()), 1 << 32),
        pc.cast(pc.binary_length(data), pa.int64()),
    )
    group = pc.if_else(values.is_valid(), group, _NO_GROUP)
    # Rows in group order; each group a run of it (one pass over the column, not one a group).
    order = pc.sort_indices(group)
    counts = pc.value_counts(group)
    runs = sorted(
        zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True)
    )
    parts: list[tuple[pa.Array, pa.Array]] = []
    alone: list[pa.Array] = []  # rows of groups too small for a template
    start = 0
    for key, count in runs:
        members = order.slice(start, count)
        start += count
        if key == _NO_GROUP:
            parts.append((members, pa.nulls(count, pa.string())))
        elif count < _SMALL_GROUP or sys.byteorder != "little":  # templates read ints in place
            alone.append(members)
        else:
            metadata = dictionaries.dictionary[key >> 32].as_py()
            parts.extend(_by_template(pc.take(data, members), metadata, members))
    if alone:
        rest = pa.concat_arrays(alone)
        metadata = pc.take(dictionaries, rest).to_pylist()
        parts.append((rest, _row_by_row(pc.take(data, rest), metadata)))
    positions = pc.sort_indices(pa.concat_arrays([p[0] for p in parts]))
    return pc.take(pa.concat_arrays([p[1] for p in parts]), positions)


def _by_template(
    data: pa.BinaryArray, metadata: bytes, members: pa.Array
) -> list[tuple[pa.Array, pa.Array]]:
    """(row positions, text) for the rows of one group: from templates while the rows left
    are many (each template traced from the first of them), row by row for the rest."""
    out: list[tuple[pa.Array, pa.Array]] = []
    keys = json_keys(metadata)
    for _ in range(_TEMPLATES_PER_GROUP):
        if len(data) < _SMALL_GROUP:
            break
        first = data[0].as_py()
        try:
            segments, payload = _trace(first, keys)
        except _Unsupported:
            break
        matches = _same_layout(data, first, payload)
        fitting = pc.indices_nonzero(matches)
        try:
            text = _from_template(pc.take(data, fitting), segments)
        except pa.ArrowInvalid:  # a string that is not UTF-8: the row decoder names it
            break
        out.append((pc.take(members, fitting), text))
        others = pc.indices_nonzero(pc.invert(matches))
        data, members = pc.take(data, others), pc.take(members, others)
    if len(data):
        out.append((members, _row_by_row(data, [metadata] * len(data))))
    return out


def _row_by_row(data: pa.BinaryArray, metadata: list[bytes]) -> pa.Array:
    values = data.to_pylist()
    return pa.array(list(map(variant_json, values, metadata)), pa.string())


def _same_layout(data: pa.BinaryArray, first: bytes, payload: set[int]) -> pa.Array:
    """Per row: whether every byte outside the template's payload equals the template's."""
    matches = pa.array([True] * len(data))
    start = None
    for at in range(len(first) + 1):
        structural = at < len(first) and at not in payload
        if structural and start is None:
            start = at
        elif not structural and start is not None:
            same = pc.equal(pc.binary_slice(data, start, at), pa.scalar(first[start:at]))
            matches = pc.and_(matches, same)
            start = None
    return matches


def _from_template(data: pa.BinaryArray, segments: list[tuple[Any, ...]]) -> pa.Array:
    pieces: list[Any] = []
    for segment in segments:
        if segment[0] == "text":
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += segment[1]
            else:
                pieces.append(segment[1])
            continue
        kind, at, size, dtype = segment
        raw = pc.binary_slice(data, at, at + size)
        if kind == "int":
            ints = pa.Array.from_buffers(dtype, len(raw), [None, raw.buffers()[2]])
            pieces.append(pc.cast(ints, pa.string()))
        elif kind == "float":  # Python's repr, NaN and ±Infinity as strings: value by value
            floats = pa.Array.from_buffers(dtype, len(raw), [None, raw.buffers()[2]])
            pieces.append(pa.array([scalar_json(x) for x in floats.to_pylist()], pa.string()))
        else:  # a short string: the cast checks its UTF-8
            pieces.append(quoted_strings(pc.cast(raw, pa.string())))
    if all(isinstance(piece, str) for piece in pieces):
        return pa.array(["".join(pieces)] * len(data), pa.string())
    return pc.binary_join_element_wise(*pieces, "")


def _trace(value: bytes, keys: tuple[str, ...]) -> tuple[list[tuple[Any, ...]], set[int]]:
    """The template of one variant: its text in segments, and the byte positions of its
    payload (integers' and short strings' bytes).

    Raises:
        _Unsupported: a value the template does not take, or bytes that do not parse (the
            row decoder then says what is wrong).
    """
    segments: list[tuple[Any, ...]] = []
    payload: set[int] = set()
    structure: set[int] = set()
    try:
        _trace_at(value, 0, keys, segments, (payload, structure))
    except (IndexError, ValueError) as err:
        raise _Unsupported from err
    if payload & structure:  # a byte read both as a value and to find the way
        raise _Unsupported
    return segments, payload


def _trace_at(
    value: bytes,
    at: int,
    keys: tuple[str, ...],
    segments: list[tuple[Any, ...]],
    seen: tuple[set[int], set[int]],
) -> None:
    payload, structure = seen
    header = value[at]
    structure.add(at)
    basic, rest = header & 0x03, header >> 2
    if basic == _SHORT_STRING:
        _trace_leaf(value, ("string", at + 1, rest, None), segments, payload)
    elif basic == _PRIMITIVE and rest in _LITERALS:
        segments.append(("text", _LITERALS[rest]))
    elif basic == _PRIMITIVE and (rest in _INT_TYPES or rest in _FLOAT_TYPES):
        kind = "int" if rest in _INT_TYPES else "float"
        size, dtype = _INT_TYPES[rest] if kind == "int" else _FLOAT_TYPES[rest]
        _trace_leaf(value, (kind, at + 1, size, dtype), segments, payload)
    elif basic in (_OBJECT, _ARRAY):
        _trace_container(value, at, basic, rest, keys, segments, seen)
    else:
        raise _Unsupported


def _trace_leaf(
    value: bytes, segment: tuple[Any, ...], segments: list[tuple[Any, ...]], payload: set[int]
) -> None:
    """A value's bytes (``segment``: kind, start, size, dtype) as a template segment."""
    _kind, start, size, _dtype = segment
    if start + size > len(value):
        raise _Unsupported
    segments.append(segment)
    payload.update(range(start, start + size))


def _trace_container(
    value: bytes,
    at: int,
    basic: int,
    rest: int,
    keys: tuple[str, ...],
    segments: list[tuple[Any, ...]],
    seen: tuple[set[int], set[int]],
) -> None:
    offset_size = (rest & 0x03) + 1
    if basic == _OBJECT:
        id_size = ((rest >> 2) & 0x03) + 1
        large = (rest >> 4) & 0x01
    else:
        id_size, large = 0, (rest >> 2) & 0x01
    count_size = 4 if large else 1
    count = _uint(value, at + 1, count_size, seen[1])
    ids_at = at + 1 + count_size
    offsets_at = ids_at + count * id_size
    values_at = offsets_at + (count + 1) * offset_size
    segments.append(("text", "{" if basic == _OBJECT else "["))
    for i in range(count):
        if i:
            segments.append(("text", ","))
        if basic == _OBJECT:
            key_id = _uint(value, ids_at + i * id_size, id_size, seen[1])
            if key_id >= len(keys):
                raise _Unsupported
            segments.append(("text", keys[key_id] + ":"))
        offset = _uint(value, offsets_at + i * offset_size, offset_size, seen[1])
        _trace_at(value, values_at + offset, keys, segments, seen)
    segments.append(("text", "}" if basic == _OBJECT else "]"))


def _uint(value: bytes, at: int, size: int, structure: set[int]) -> int:
    if at + size > len(value):
        raise _Unsupported
    structure.update(range(at, at + size))
    return int.from_bytes(value[at : at + size], "little")
