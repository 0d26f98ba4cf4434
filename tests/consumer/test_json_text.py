"""Nested values as JSON text: the C encoder's fast path writes exactly what the per-value
writer writes, for every type it takes and every value those types hold (NaN, ±Infinity,
-0.0, nulls at every depth, non-ASCII and control characters, binary, instants, empty lists),
and the types it does not take still go through the writer."""

from __future__ import annotations

import datetime as dt
import json
import math
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millpond.consumer.sinks._json_columns import columnar
from millpond.consumer.sinks._values import _dumps, _encodable, json_text

UTC = dt.UTC
WRITER_ONLY = [
    pa.map_(pa.string(), pa.int64()),
    pa.struct([pa.field("d", pa.decimal128(10, 2))]),
    pa.list_(pa.dictionary(pa.int8(), pa.string())),
    pa.struct([pa.field("x", pa.int8()), pa.field("x", pa.int8())]),
    pa.list_(pa.float16()),
    pa.list_(pa.month_day_nano_interval()),
    pa.struct(
        [
            pa.field("value", pa.binary()),
            pa.field("metadata", pa.binary(), metadata={b"variant": b"true"}),
        ]
    ),
]


def _by_writer(values: pa.Array) -> list[str | None]:
    return [None if v is None else _dumps(v, values.type) for v in values.to_pylist()]


def _same_as_writer(values: pa.Array) -> None:
    assert json_text(pa.chunked_array([values])).to_pylist() == _by_writer(values)


def test_every_leaf_type_and_awkward_value_reads_the_same_both_ways() -> None:
    leaf = pa.struct(
        [
            pa.field("s", pa.string()),
            pa.field("ls", pa.large_string()),
            pa.field("i8", pa.int8()),
            pa.field("u64", pa.uint64()),
            pa.field("b", pa.bool_()),
            pa.field("f32", pa.float32()),
            pa.field("f64", pa.float64()),
            pa.field("bin", pa.binary()),
            pa.field("fbin", pa.binary(3)),
            pa.field("ts", pa.timestamp("us", tz="America/New_York")),
            pa.field("tsn", pa.timestamp("ms")),
            pa.field("d", pa.date32()),
            pa.field("t", pa.time64("us")),
            pa.field("dur", pa.duration("us")),
            pa.field("n", pa.null()),
        ]
    )
    dtype = pa.struct(
        [
            pa.field("leaf", leaf),
            pa.field("many", pa.list_(leaf)),
            pa.field("fixed", pa.list_(pa.int32(), 2)),
            pa.field("deep", pa.large_list(pa.list_(pa.string()))),
        ]
    )
    assert _encodable(dtype)
    first = {
        "s": 'quote " backslash \\ tab \t nul \x00 é 😀 \u2028',
        "ls": "",
        "i8": -128,
        "u64": 2**64 - 1,
        "b": False,
        "f32": 0.1,
        "f64": -0.0,
        "bin": b"\x00\xff",
        "fbin": b"abc",
        "ts": dt.datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        "tsn": dt.datetime(2024, 3, 10, 2, 30),
        "d": dt.date(1, 1, 1),
        "t": dt.time(23, 59, 59, 999_999),
        "dur": dt.timedelta(days=-1, microseconds=1),
        "n": None,
    }
    special = dict(first, f32=float("inf"), f64=float("nan"))
    empty = dict.fromkeys(first)
    rows = [
        {"leaf": first, "many": [first, empty], "fixed": [1, None], "deep": [["a"], [], None]},
        {"leaf": special, "many": [], "fixed": None, "deep": []},  # NaN: the writer's row
        {"leaf": None, "many": None, "fixed": [None, None], "deep": None},
        {"leaf": empty, "many": [None, special], "fixed": [-1, 2**31 - 1], "deep": [[None]]},
        None,
    ]
    values = pa.array(rows, dtype)
    _same_as_writer(values)
    text = json_text(pa.chunked_array([values])).to_pylist()
    assert text[4] is None
    assert '"f64":"NaN"' in text[1]
    assert json.loads(text[0])["leaf"]["bin"] == "AP8="


@pytest.mark.parametrize("dtype", WRITER_ONLY, ids=str)
def test_types_the_encoder_cannot_write_alike_go_through_the_writer(dtype: pa.DataType) -> None:
    assert not _encodable(dtype)


def test_a_map_and_a_decimal_inside_a_struct_still_read_as_before() -> None:
    dtype = pa.struct(
        [pa.field("m", pa.map_(pa.string(), pa.float64())), pa.field("d", pa.decimal128(5, 2))]
    )
    values = pa.array([{"m": [("k", 1.5), ("nan", math.nan)], "d": Decimal("-1.20")}], dtype)
    assert json_text(pa.chunked_array([values])).to_pylist() == [
        '{"m":{"k":1.5,"nan":"NaN"},"d":-1.20}'
    ]


_LEAVES: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.string(), st.text()),
    (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    (pa.bool_(), st.booleans()),
    (pa.float64(), st.floats()),
    (pa.float32(), st.floats(width=32)),
    (pa.binary(), st.binary(max_size=8)),
    (
        pa.timestamp("us", tz="UTC"),
        st.datetimes(
            min_value=dt.datetime(1, 1, 2),
            max_value=dt.datetime(9999, 12, 30),
            timezones=st.just(UTC),
        ),
    ),
    (pa.date32(), st.dates()),
]


@st.composite
def _nested(draw: st.DrawFn, depth: int = 0) -> tuple[pa.DataType, st.SearchStrategy[Any]]:
    kind = draw(st.sampled_from(["leaf", "list", "struct"] if depth < 3 else ["leaf"]))
    if kind == "leaf":
        return draw(st.sampled_from(_LEAVES))
    if kind == "list":
        item_type, items = draw(_nested(depth + 1))
        return pa.list_(item_type), st.lists(st.none() | items, max_size=4)
    count = draw(st.integers(1, 3))
    children = [draw(_nested(depth + 1)) for _ in range(count)]
    dtype = pa.struct([pa.field(f"f{i}", child[0]) for i, child in enumerate(children)])
    values = st.fixed_dictionaries(
        {f"f{i}": st.none() | child[1] for i, child in enumerate(children)}
    )
    return dtype, values


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_nested_values_read_the_same_both_ways(data: st.DataObject) -> None:
    dtype, values = data.draw(_nested())
    dtype, values = pa.list_(dtype), st.lists(st.none() | values, max_size=4)
    rows = data.draw(st.lists(st.none() | values, min_size=1, max_size=5))
    _same_as_writer(pa.array(rows, dtype))


# -- a column at a time (consumer/sinks/_json_columns.py) ---------------------------------------

VARIANT = pa.struct(
    [
        pa.field("value", pa.binary()),
        pa.field("metadata", pa.binary(), metadata={b"variant": b"true"}),
    ]
)
# {"a": [1, 2.5, "x"], "b": null} and "plain", as Spark 4 wrote them (see test_variant.py)
SPARK_VARIANTS = [
    {
        "value": b"\x02\x02\x00\x01\x00\x10\x11\x03\x03\x00\x02\x08\n\x0c\x01 \x01\x19\x00\x00"
        b"\x00\x05x\x00",
        "metadata": b"\x01\x02\x00\x01\x02ab",
    },
    {"value": b"\x15plain", "metadata": b"\x01\x00\x00"},
]
COLUMN_WISE = [
    pa.map_(pa.string(), pa.int64()),
    pa.map_(pa.int32(), pa.list_(pa.float64())),
    pa.struct([pa.field("d", pa.decimal128(10, 2)), pa.field("e", pa.decimal128(5, -2))]),
    pa.list_(pa.dictionary(pa.int8(), pa.string())),
    pa.large_list(pa.struct([pa.field("t", pa.time32("ms")), pa.field("u", pa.date64())])),
    pa.list_(pa.duration("s"), 3),
    pa.struct([]),
    VARIANT,
    pa.list_(VARIANT),
]
WRITER_ONLY_STILL = [
    pa.struct([pa.field("x", pa.int8()), pa.field("x", pa.int8())]),
    pa.list_(pa.float16()),
    pa.list_(pa.month_day_nano_interval()),
    pa.list_(pa.timestamp("ns")),
    pa.struct([pa.field("t", pa.time64("ns"))]),
    pa.list_view(pa.int32()),
]


@pytest.mark.parametrize("dtype", COLUMN_WISE, ids=str)
def test_types_the_writer_alone_took_are_written_column_wise(dtype: pa.DataType) -> None:
    assert columnar(dtype)


@pytest.mark.parametrize("dtype", WRITER_ONLY_STILL, ids=str)
def test_what_the_column_writer_cannot_write_alike_still_goes_through_the_writer(
    dtype: pa.DataType,
) -> None:
    assert not columnar(dtype)


def test_maps_decimals_variants_and_odd_widths_read_the_same_both_ways() -> None:
    rows: dict[pa.DataType, list[Any]] = {
        COLUMN_WISE[0]: [[("k", 1), ('q"\\\n\x01é', None)], [], None, [("", -(2**63))]],
        COLUMN_WISE[1]: [[(1, [1.5, math.nan, None]), (-2, None)], None, [(0, [])]],
        COLUMN_WISE[2]: [
            {"d": Decimal("-1.20"), "e": Decimal("1.23E+4")},
            {"d": None, "e": Decimal("0E+2")},
            None,
            {"d": Decimal("0.00"), "e": None},
        ],
        COLUMN_WISE[3]: [["a", None, "a", 'b"'], None, []],
        COLUMN_WISE[4]: [
            [{"t": dt.time(0, 0, 0, 1000), "u": dt.date(1, 1, 1)}, None, {"t": None, "u": None}],
            None,
        ],
        COLUMN_WISE[5]: [[dt.timedelta(seconds=-1), None, dt.timedelta(days=3)], None],
        COLUMN_WISE[6]: [{}, None, {}],
        COLUMN_WISE[7]: [SPARK_VARIANTS[0], None, SPARK_VARIANTS[1]],
        COLUMN_WISE[8]: [SPARK_VARIANTS, [None], None, []],
    }
    for dtype, values in rows.items():
        _same_as_writer(pa.array(values, dtype))
    assert json_text(pa.chunked_array([pa.array(rows[VARIANT], VARIANT)])).to_pylist() == [
        '{"a":[1,2.5,"x"],"b":null}',
        None,
        '"plain"',
    ]
    assert (
        json_text(pa.chunked_array([pa.array(rows[COLUMN_WISE[2]], COLUMN_WISE[2])]))[0].as_py()
        == '{"d":-1.20,"e":12300}'
    )


def test_every_control_character_is_escaped_as_json_dumps_escapes_it() -> None:
    every = "".join(chr(c) for c in range(0x20)) + '"\\\x7f\u2028😀'
    values = pa.array([[every], [every[::-1]], ["plain"]], pa.list_(pa.string()))
    _same_as_writer(values)
    assert json.loads(json_text(pa.chunked_array([values]))[0].as_py()) == [every]


def test_slices_and_chunks_read_the_same_as_whole_rows() -> None:
    # Sliced list and map arrays keep their children whole: the offsets say where a row is.
    lists = pa.array([[1], None, [2, 3], [], [4, None, 5], None, [6]], pa.list_(pa.int64()))
    maps = pa.array(
        [[("a", 1)], None, [("b", 2), ("c", 3)], [], [("d", None)], None, [("e", 6)]],
        pa.map_(pa.string(), pa.int64()),
    )
    nested = pa.array(
        [{"l": [[1, None]], "s": "x"}, None, {"l": None, "s": None}, {"l": [[], None], "s": "y"}]
        * 2,
        pa.struct([pa.field("l", pa.list_(pa.list_(pa.int8()))), pa.field("s", pa.string())]),
    )
    for values in (lists, maps, nested):
        for start in range(len(values)):
            for length in range(len(values) - start + 1):
                _same_as_writer(values.slice(start, length))
        chunked = pa.chunked_array([values.slice(0, 3), values.slice(3), values.slice(0, 0)])
        assert json_text(chunked).to_pylist() == _by_writer(values)


_MAP_KEYS: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.string(), st.text(max_size=6)),
    (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    (pa.float64(), st.floats()),
    (pa.bool_(), st.booleans()),
]


@st.composite
def _column_wise(draw: st.DrawFn, depth: int = 0) -> tuple[pa.DataType, st.SearchStrategy[Any]]:
    kinds = ["leaf", "decimal", "list", "large", "fixed", "map", "struct"]
    kind = draw(st.sampled_from(kinds if depth < 3 else kinds[:2]))
    if kind == "leaf":
        return draw(st.sampled_from(_LEAVES))
    if kind == "decimal":
        scale = draw(st.integers(-3, 6))
        digits = st.integers(-(10**12) + 1, 10**12 - 1)  # the unscaled value: 12 digits
        return pa.decimal128(12, scale), digits.map(lambda n: Decimal(n).scaleb(-scale))
    if kind == "map":
        key_type, keys = draw(st.sampled_from(_MAP_KEYS))
        item_type, items = draw(_column_wise(depth + 1))
        pairs = st.lists(st.tuples(keys, st.none() | items), max_size=3)
        return pa.map_(key_type, item_type), pairs
    if kind in ("list", "large", "fixed"):
        item_type, items = draw(_column_wise(depth + 1))
        if kind == "fixed":
            return pa.list_(item_type, 2), st.lists(st.none() | items, min_size=2, max_size=2)
        make = pa.list_ if kind == "list" else pa.large_list
        return make(item_type), st.lists(st.none() | items, max_size=4)
    count = draw(st.integers(1, 3))
    children = [draw(_column_wise(depth + 1)) for _ in range(count)]
    dtype = pa.struct([pa.field(f"f{i}", child[0]) for i, child in enumerate(children)])
    values = st.fixed_dictionaries(
        {f"f{i}": st.none() | child[1] for i, child in enumerate(children)}
    )
    return dtype, values


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_maps_lists_and_structs_read_the_same_column_wise(data: st.DataObject) -> None:
    dtype, values = data.draw(_column_wise())
    dtype, values = pa.list_(dtype), st.lists(st.none() | values, max_size=4)
    assert columnar(dtype)
    rows = data.draw(st.lists(st.none() | values, min_size=1, max_size=6))
    array = pa.array(rows, dtype)
    _same_as_writer(array)
    start = data.draw(st.integers(0, len(array)))
    _same_as_writer(array.slice(start))
