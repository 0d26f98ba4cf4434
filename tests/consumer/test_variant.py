"""Spark ``VARIANT`` values reach the databases as the JSON they hold, not as Spark's binary
encoding: the decoder against bytes Spark wrote, against values built by hand from the
encoding's specification (Apache Parquet ``VariantEncoding.md``), and on damaged bytes."""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millpond.consumer.sinks import _variant_columns
from millpond.consumer.sinks._values import for_postgres, for_sqlite
from millpond.consumer.sinks._variant import is_variant, variant_json
from millpond.consumer.sinks.types import ColumnType, Kind, column_type
from millpond.errors import FormatError

# Written by Spark 4 (``parse_json``), taken from a batch object as they arrived.
SPARK_OBJECT = (
    b"\x02\x02\x00\x01\x00\x10\x11\x03\x03\x00\x02\x08\n\x0c\x01 \x01\x19\x00\x00\x00\x05x\x00",
    b"\x01\x02\x00\x01\x02ab",
)  # {"a": [1, 2.5, "x"], "b": null}
SPARK_STRING = (b"\x15plain", b"\x01\x00\x00")  # "plain"

VARIANT = pa.struct(
    [
        pa.field("value", pa.binary(), nullable=False),
        pa.field("metadata", pa.binary(), nullable=False, metadata={"variant": "true"}),
    ]
)
NO_KEYS = b"\x01\x00\x00"  # version 1, 1-byte offsets, an empty dictionary


def _primitive(type_id: int, body: bytes = b"") -> bytes:
    return bytes([type_id << 2]) + body


def _metadata(keys: list[str]) -> bytes:
    """Version 1 with 2-byte offsets: the key count, len + 1 offsets, then the keys."""
    raw = [k.encode() for k in keys]
    offsets = [0]
    for key in raw:
        offsets.append(offsets[-1] + len(key))
    header = bytes([0x01 | (1 << 6)])
    sizes = [len(keys), *offsets]
    return header + b"".join(n.to_bytes(2, "little") for n in sizes) + b"".join(raw)


def _object(ids: list[int], values: list[bytes], *, large: bool = False) -> bytes:
    # 2-byte field ids and 2-byte offsets, to exercise sizes other than 1
    header = (0b01 << 2) | (0b01 << 4) | ((1 if large else 0) << 6) | 2
    count = len(ids).to_bytes(4 if large else 1, "little")
    offsets = [0]
    for value in values:
        offsets.append(offsets[-1] + len(value))
    return (
        bytes([header])
        + count
        + b"".join(i.to_bytes(2, "little") for i in ids)
        + b"".join(o.to_bytes(2, "little") for o in offsets)
        + b"".join(values)
    )


def _array(values: list[bytes], *, large: bool = False) -> bytes:
    header = (0b00 << 2) | ((1 if large else 0) << 4) | 3
    count = len(values).to_bytes(4 if large else 1, "little")
    offsets = [0]
    for value in values:
        offsets.append(offsets[-1] + len(value))
    return bytes([header]) + count + bytes(offsets) + b"".join(values)


def test_spark_written_variants_read_as_the_json_they_hold() -> None:
    assert variant_json(*SPARK_OBJECT) == '{"a":[1,2.5,"x"],"b":null}'
    assert variant_json(*SPARK_STRING) == '"plain"'


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (_primitive(0), "null"),
        (_primitive(1), "true"),
        (_primitive(2), "false"),
        (_primitive(3, b"\x80"), "-128"),
        (_primitive(4, struct.pack("<h", -32768)), "-32768"),
        (_primitive(5, struct.pack("<i", 2**31 - 1)), "2147483647"),
        (_primitive(6, struct.pack("<q", -(2**63))), str(-(2**63))),
        (_primitive(7, struct.pack("<d", 0.1)), "0.1"),
        (_primitive(7, struct.pack("<d", float("nan"))), '"NaN"'),
        (_primitive(7, struct.pack("<d", float("-inf"))), '"-Infinity"'),
        (_primitive(14, struct.pack("<f", 1.5)), "1.5"),
        (_primitive(8, b"\x02" + struct.pack("<i", 150)), "1.50"),
        (_primitive(9, b"\x00" + struct.pack("<q", -7)), "-7"),
        (
            _primitive(10, b"\x26" + (10**38 - 1).to_bytes(16, "little", signed=True)),
            "0." + "9" * 38,
        ),
        (_primitive(11, struct.pack("<i", 19782)), '"2024-02-29"'),
        (
            _primitive(12, struct.pack("<q", 1_710_055_800_000_001)),
            '"2024-03-10T07:30:00.000001+00:00"',
        ),
        (_primitive(13, struct.pack("<q", -1)), '"1969-12-31T23:59:59.999999"'),
        (_primitive(17, struct.pack("<q", 45_296_123_456)), '"12:34:56.123456"'),
        (_primitive(18, struct.pack("<q", 1_500)), '"1970-01-01T00:00:00.000001500+00:00"'),
        (_primitive(15, struct.pack("<I", 3) + b"\x00\xff\x10"), '"AP8Q"'),
        (_primitive(16, struct.pack("<I", 6) + "héllo".encode()), '"héllo"'),
        (_primitive(16, struct.pack("<I", 2) + "hé".encode()[:2]), None),
        (_primitive(20, uuid.UUID(int=1).bytes), f'"{uuid.UUID(int=1)}"'),
        (bytes([(3 << 2) | 1]) + "é✓".encode()[:3], None),
    ],
)
def test_every_primitive_reads_in_the_documented_json_form(
    value: bytes, expected: str | None
) -> None:
    if expected is None:  # a string cut inside a UTF-8 sequence
        with pytest.raises(FormatError, match="not UTF-8"):
            variant_json(value, NO_KEYS)
        return
    assert variant_json(value, NO_KEYS) == expected
    json.loads(expected)


def test_objects_and_arrays_with_wide_offsets_and_large_counts() -> None:
    metadata = _metadata(["b", "é"])
    inner = _array([_primitive(3, b"\x01"), bytes([(1 << 2) | 1]) + b"x"], large=True)
    value = _object([0, 1], [inner, _object([], [])], large=True)
    assert variant_json(value, metadata) == '{"b":[1,"x"],"é":{}}'


@pytest.mark.parametrize(
    ("value", "metadata", "message"),
    [
        (b"", NO_KEYS, "expected a header at byte 0"),
        (_primitive(6, b"\x00\x01"), NO_KEYS, "expected 8 bytes at byte 1"),
        (_primitive(21), NO_KEYS, "unknown id 21"),
        (_primitive(0), b"\x02\x00\x00", "version at byte 0: expected 1, found 2"),
        (_primitive(0), b"", "expected a header byte"),
        (_object([5], [_primitive(0)]), _metadata(["a"]), "expected below 1, found 5"),
    ],
)
def test_damaged_variants_raise_naming_the_byte(
    value: bytes, metadata: bytes, message: str
) -> None:
    with pytest.raises(FormatError, match=message):
        variant_json(value, metadata)


def test_the_variant_struct_is_recognised_only_with_sparks_marker() -> None:
    assert is_variant(VARIANT)
    plain = pa.struct([("value", pa.binary()), ("metadata", pa.binary())])
    assert not is_variant(plain)  # a user's own struct with those names stays a struct
    assert column_type(VARIANT) == ColumnType(Kind.JSON)


def test_a_variant_column_is_written_as_json_text_to_both_databases() -> None:
    values = pa.chunked_array(
        [
            pa.array(
                [
                    {"value": SPARK_OBJECT[0], "metadata": SPARK_OBJECT[1]},
                    None,
                    {"value": SPARK_STRING[0], "metadata": SPARK_STRING[1]},
                ],
                VARIANT,
            )
        ]
    )
    nested = pa.chunked_array(
        [pa.array([[{"value": SPARK_STRING[0], "metadata": SPARK_STRING[1]}]], pa.list_(VARIANT))]
    )
    expected = ['{"a":[1,2.5,"x"],"b":null}', None, '"plain"']
    assert for_postgres(values, ColumnType(Kind.JSON)).to_pylist() == expected
    assert for_sqlite(values, ColumnType(Kind.JSON))[0].to_pylist() == expected
    assert for_postgres(nested, ColumnType(Kind.JSON)).to_pylist() == ['["plain"]']


def _number_variant(text: str) -> dict[str, bytes]:
    """A variant holding an exact decimal, encoded as Spark does (decimal16, scale, LE)."""
    from decimal import Decimal

    sign, digits, exponent = Decimal(text).as_tuple()
    assert isinstance(exponent, int)
    unscaled = (-1 if sign else 1) * int("".join(map(str, digits)))
    body = bytes([-exponent]) + unscaled.to_bytes(16, "little", signed=True)
    return {"value": _primitive(10, body), "metadata": NO_KEYS}


def test_sqlite_keeps_a_variant_number_as_its_exact_json_text(tmp_path: Path) -> None:
    # Under the old declared type "JSON" (NUMERIC affinity) SQLite turned this text into a
    # 15-digit REAL; JSON_TEXT has TEXT affinity.
    from consumer_support import Database

    from millpond.consumer import ConsumedBatch, Metadata
    from millpond.formats.arrow import encode_ipc

    exact = "12345678901234567890123.000000000001"
    table = pa.table({"v": pa.array([_number_variant(exact), None], VARIANT)})
    database = Database("sqlite", f"sqlite://{tmp_path / 'variants.db'}")
    with database.sink() as sink:
        assert sink.write(
            ConsumedBatch(
                entries=tuple(encode_ipc(table)),
                sequence=0,
                location="ingest/00000000000000000000000000.batch",
                metadata=(Metadata(0, 1_000, b""),),
            )
        )
    rows = database.query(f'SELECT v, typeof(v) FROM "{database.table}" ORDER BY rowid')
    assert rows == [(exact, "text"), (None, "null")]
    declared = database.query(f'PRAGMA table_info("{database.table}")')
    assert {str(row[1]): str(row[2]) for row in declared}["v"] == "JSON_TEXT"


def test_a_json_column_of_an_older_sqlite_table_is_still_json() -> None:
    from millpond.consumer.sinks.types import SQLITE

    assert SQLITE.parse("JSON") == ColumnType(Kind.JSON)
    assert SQLITE.parse("JSON_TEXT") == ColumnType(Kind.JSON)


# -- a column at a time (consumer/sinks/_variant_columns.py) ------------------------------------


def _encode(value: Any, keys: list[str]) -> bytes:
    """``value`` in the variant encoding, as Spark's ``parse_json`` writes it (the smallest
    integer width that holds it; strings under 64 bytes short)."""
    if value is None or isinstance(value, bool):
        return _primitive({None: 0, True: 1, False: 2}[value])
    if isinstance(value, int):
        for type_id, size in ((3, 1), (4, 2), (5, 4), (6, 8)):
            if -(1 << (8 * size - 1)) <= value < 1 << (8 * size - 1):
                return _primitive(type_id, value.to_bytes(size, "little", signed=True))
    if isinstance(value, float):
        return _primitive(7, struct.pack("<d", value))
    if isinstance(value, str):
        raw = value.encode()
        if len(raw) < 64:
            return bytes([(len(raw) << 2) | 1]) + raw
        return _primitive(16, len(raw).to_bytes(4, "little") + raw)
    if isinstance(value, list):
        return _array([_encode(item, keys) for item in value])
    assert isinstance(value, dict)
    names = sorted(value)
    return _object([keys.index(k) for k in names], [_encode(value[k], keys) for k in names])


def _column(rows: list[Any], keys: list[str]) -> pa.Array:
    metadata = _metadata(keys)
    return pa.array(
        [
            None if row is None else {"value": _encode(row, keys), "metadata": metadata}
            for row in rows
        ],
        VARIANT,
    )


def _row_by_row(column: pa.Array) -> list[str | None]:
    return [
        None if v is None else variant_json(v["value"], v["metadata"]) for v in column.to_pylist()
    ]


def _json(column: pa.Array) -> list[str | None]:
    return for_postgres(pa.chunked_array([column]), ColumnType(Kind.JSON)).to_pylist()


_TEXT = st.text(alphabet='ab"\\\n\x01é😀 ', min_size=0, max_size=6)
_INT = st.one_of(
    st.integers(-100, 100), st.integers(-(2**15), 2**15 - 1), st.integers(-(2**40), 2**40)
)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_column_reads_as_row_by_row_whatever_its_layouts(data: st.DataObject) -> None:
    """Rows of a few shapes (groups sharing a layout), integers of every width, strings with
    quotes, control characters and multi-byte characters, floats, NULLs, and a shape that
    only looks alike (the same length, other keys). Groups of 4 rows get a template here."""
    small_group = _variant_columns._SMALL_GROUP
    _variant_columns._SMALL_GROUP = 4
    try:
        _random_column_reads_as_row_by_row(data)
    finally:
        _variant_columns._SMALL_GROUP = small_group


def _random_column_reads_as_row_by_row(data: st.DataObject) -> None:
    keys = ["a", "b", "c", "n", "s"]
    shapes = [
        lambda: {"n": data.draw(_INT)},
        lambda: {"n": data.draw(_INT), "s": data.draw(_TEXT), "a": [data.draw(_INT), None, True]},
        lambda: {"b": {"c": data.draw(_TEXT)}, "n": data.draw(st.floats())},
        lambda: [data.draw(_INT), data.draw(_TEXT)],
        lambda: data.draw(_INT),
        lambda: {"a": data.draw(st.integers(0, 99)), "b": 1},
        lambda: {"b": data.draw(st.integers(0, 99)), "c": 1},  # the same length as the last
    ]
    picks = data.draw(st.lists(st.integers(-1, len(shapes) - 1), min_size=40, max_size=120))
    rows = [None if pick < 0 else shapes[pick]() for pick in picks]
    column = _column(rows, keys)
    assert _json(column) == _row_by_row(column)
    assert _json(column.slice(7)) == _row_by_row(column.slice(7))


def test_many_rows_of_one_layout_and_a_few_others_read_as_row_by_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded_alone: list[int] = []
    row_by_row = _variant_columns._row_by_row

    def counted(data: pa.Array, metadata: list[bytes]) -> pa.Array:
        decoded_alone.append(len(data))
        return row_by_row(data, metadata)

    monkeypatch.setattr(_variant_columns, "_row_by_row", counted)
    keys = ["a", "b", "n", "s"]
    rows: list[Any] = [{"n": i, "s": f"v{i % 10}"} for i in range(1000)]  # 3 int widths
    rows[500] = {"a": 1, "b": 2}  # another dictionary use, another layout
    rows[501] = None
    rows[502] = {"n": 1.5, "s": "xx"}  # a float where the layout has an integer
    column = _column(rows, keys)
    text = _json(column)
    assert text == _row_by_row(column)
    assert text[7] == '{"n":7,"s":"v7"}'
    assert text[501] is None
    assert sum(decoded_alone) == 2  # the other layout and the float; the rest by template
    # Two key dictionaries in one column.
    other = _column([{"s": "x"}] * 20, ["s"])
    mixed = pa.concat_arrays([column.slice(0, 30), other, column.slice(30, 30)])
    assert _json(mixed) == _row_by_row(mixed)


def test_a_string_that_is_not_utf8_in_a_column_is_named_as_row_by_row() -> None:
    keys = ["s"]
    metadata = _metadata(keys)
    good = _object([0], [bytes([(2 << 2) | 1]) + b"ok"])
    bad = _object([0], [bytes([(2 << 2) | 1]) + b"\xff\xfe"])
    column = pa.array(
        [{"value": good, "metadata": metadata}] * 30 + [{"value": bad, "metadata": metadata}],
        VARIANT,
    )
    with pytest.raises(FormatError, match="not UTF-8"):
        _json(column)
