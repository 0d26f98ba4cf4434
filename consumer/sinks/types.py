"""How Arrow (and so Spark) types become database columns, and how a column's type evolves.

One logical :class:`ColumnType` sits between the Arrow type of a batch and the SQL type of a
table: :func:`column_type` maps an Arrow type to it, each dialect maps it to and from its SQL
spelling (:data:`POSTGRES` and :data:`SQLITE`), and :func:`reconcile` decides, once for both
databases, whether a column of one type can take values of another and to what type it must
widen. Values are rewritten for a column by :mod:`millpond.consumer.sinks._values`.

Rules worth knowing:

- Every time-zone-aware Arrow timestamp is the same instant type, whatever the zone is
  spelled (Spark writes the session zone, ``Etc/UTC`` or ``America/New_York``; PostgreSQL
  reflects ``UTC``): the zone is how an instant is displayed, not what it is.
- A null-typed column (all nulls so far) has no column type: the column is created when a
  batch first brings values, and a column that holds nothing but NULLs takes any type.
- Widening goes up ``smallint < integer < bigint``, any integer or float to ``double``,
  integers and decimals to a decimal wide enough for both. Anything else (a string into an
  integer column, an instant into a local-time column) cannot be reconciled.

:data:`SPARK_TYPES` lists every Spark SQL type the data source writes with the Arrow type
Spark hands over; :func:`mapping_markdown` renders the table the docs' types page shows (the
site's build asks for it), and a test reads every value back from both databases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import pyarrow as pa

__all__ = [
    "POSTGRES",
    "SPARK_TYPES",
    "SQLITE",
    "ColumnType",
    "Dialect",
    "Kind",
    "UnsupportedTypeError",
    "column_type",
    "mapping_markdown",
    "reconcile",
]


class UnsupportedTypeError(ValueError):
    """An Arrow type no column type stands for."""


class Kind(StrEnum):
    """The logical type of a column."""

    BOOLEAN = "boolean"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    DECIMAL = "decimal"
    STRING = "string"
    BINARY = "binary"
    DATE = "date"
    TIME = "time"
    TIMESTAMP = "timestamp"
    """A local date-time without a zone (Spark ``timestamp_ntz``)."""
    INSTANT = "instant"
    """A point in time (Spark ``timestamp``; Arrow timestamps with any zone)."""
    INTERVAL = "interval"
    JSON = "json"
    """Nested values (arrays, maps, structs) as JSON text."""
    OTHER = "other"
    """A column the sink did not create and does not know (left as the database has it)."""


_INTEGERS = (Kind.INT16, Kind.INT32, Kind.INT64)
_INTEGER_DIGITS = {Kind.INT16: 5, Kind.INT32: 10, Kind.INT64: 19}
_MAX_NUMERIC_PRECISION = 1000  # PostgreSQL's limit; SQLite keeps decimals as text


@dataclass(frozen=True, slots=True)
class ColumnType:
    """A column's logical type, with the parameters its SQL type carries."""

    kind: Kind
    precision: int | None = None
    """Decimal digits (``DECIMAL``)."""
    scale: int | None = None
    """Digits after the point (``DECIMAL``; negative rounds to tens, hundreds, ...)."""
    length: int | None = None
    """Longest string a ``varchar(n)`` column takes (``STRING``; ``None``: unbounded)."""
    sql: str = ""
    """The database's own spelling, for columns of kind ``OTHER`` and for messages."""

    def __str__(self) -> str:
        if self.kind is Kind.DECIMAL:
            return f"decimal({self.precision},{self.scale})"
        if self.kind is Kind.STRING and self.length is not None:
            return f"string({self.length})"
        if self.kind is Kind.OTHER:
            return self.sql or "unknown"
        return self.kind.value


def column_type(dtype: pa.DataType) -> ColumnType | None:
    """The column type an Arrow type needs; ``None`` for the null type (no values yet).

    Raises:
        UnsupportedTypeError: no column type stands for ``dtype`` (a union, say).
    """
    t = pa.types
    if t.is_dictionary(dtype):
        return column_type(dtype.value_type)
    if isinstance(dtype, pa.ExtensionType):
        return column_type(dtype.storage_type)
    if t.is_null(dtype):
        return None
    if t.is_boolean(dtype):
        return ColumnType(Kind.BOOLEAN)
    if t.is_int8(dtype) or t.is_int16(dtype) or t.is_uint8(dtype):
        return ColumnType(Kind.INT16)
    if t.is_int32(dtype) or t.is_uint16(dtype):
        return ColumnType(Kind.INT32)
    if t.is_int64(dtype) or t.is_uint32(dtype):
        return ColumnType(Kind.INT64)
    if t.is_uint64(dtype):
        return ColumnType(Kind.DECIMAL, precision=20, scale=0)
    if t.is_float16(dtype) or t.is_float32(dtype):
        return ColumnType(Kind.FLOAT32)
    if t.is_float64(dtype):
        return ColumnType(Kind.FLOAT64)
    if t.is_decimal(dtype):
        return ColumnType(Kind.DECIMAL, precision=dtype.precision, scale=dtype.scale)
    if t.is_string(dtype) or t.is_large_string(dtype) or t.is_string_view(dtype):
        return ColumnType(Kind.STRING)
    if (
        t.is_binary(dtype)
        or t.is_large_binary(dtype)
        or t.is_fixed_size_binary(dtype)
        or t.is_binary_view(dtype)
    ):
        return ColumnType(Kind.BINARY)
    if t.is_date(dtype):
        return ColumnType(Kind.DATE)
    if t.is_time(dtype):
        return ColumnType(Kind.TIME)
    if t.is_timestamp(dtype):
        return ColumnType(Kind.INSTANT if dtype.tz is not None else Kind.TIMESTAMP)
    if t.is_duration(dtype):
        return ColumnType(Kind.INTERVAL)
    if t.is_nested(dtype) and not t.is_union(dtype) and not t.is_run_end_encoded(dtype):
        return ColumnType(Kind.JSON)
    raise UnsupportedTypeError(f"Arrow type {dtype} has no column type")


def reconcile(existing: ColumnType, incoming: ColumnType) -> ColumnType | None:
    """The type a column of type ``existing`` must have to take ``incoming`` values.

    Returns:
        ``existing`` when it takes them as it is, a wider type when the column must be
        altered, ``None`` when the two cannot be reconciled.
    """
    if existing.kind is Kind.OTHER:
        return existing  # not ours to judge: the database takes the values or says why
    if incoming.kind is existing.kind:
        if existing.kind is Kind.DECIMAL:
            return _wider_decimal(existing, incoming)
        if (
            existing.kind is Kind.STRING
            and existing.length is not None
            and (incoming.length is None or incoming.length > existing.length)
        ):
            return incoming
        return existing
    kinds = {existing.kind, incoming.kind}
    if kinds <= set(_INTEGERS):
        return max(existing, incoming, key=lambda column: _INTEGERS.index(column.kind))
    if kinds <= {*_INTEGERS, Kind.FLOAT32, Kind.FLOAT64}:
        return ColumnType(Kind.FLOAT64)
    if kinds <= {*_INTEGERS, Kind.DECIMAL}:
        integer = incoming if incoming.kind is not Kind.DECIMAL else existing
        as_decimal = ColumnType(Kind.DECIMAL, precision=_INTEGER_DIGITS[integer.kind], scale=0)
        decimal = existing if existing.kind is Kind.DECIMAL else incoming
        return _wider_decimal(decimal, as_decimal)
    return None


def _wider_decimal(a: ColumnType, b: ColumnType) -> ColumnType | None:
    assert a.precision is not None
    assert a.scale is not None
    assert b.precision is not None
    assert b.scale is not None
    scale = max(a.scale, b.scale)
    precision = max(a.precision - a.scale, b.precision - b.scale) + scale
    if precision > _MAX_NUMERIC_PRECISION:
        return None
    if precision == a.precision and scale == a.scale:
        return a
    return ColumnType(Kind.DECIMAL, precision=precision, scale=scale)


# -- dialects ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one database spells column types, and what each kind's values become there."""

    name: str
    types: dict[Kind, str]
    """The SQL type the sink declares per kind (``{p}``, ``{s}`` for decimals)."""
    values: dict[Kind, str]
    """What a value of each kind is once stored (documentation, shown in the docs' types page)."""
    aliases: dict[str, Kind]
    """Further SQL spellings (lower case, parameters stripped) reflected as a kind."""
    bounded_string: str
    """The SQL type of a string column limited to ``{n}`` characters."""

    def sql_type(self, column: ColumnType) -> str:
        """The SQL type to declare for ``column``."""
        if column.kind is Kind.OTHER:
            return column.sql
        if column.kind is Kind.STRING and column.length is not None:
            return self.bounded_string.format(n=column.length)
        return self.types[column.kind].format(p=column.precision, s=column.scale)

    def parse(self, declared: str) -> ColumnType:
        """The column type of a reflected SQL type (``OTHER`` when it is none of ours)."""
        text = " ".join(declared.strip().lower().split())
        match = re.fullmatch(r"(.*?)\s*\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)(.*)", text)
        base = text if match is None else f"{match.group(1)}{match.group(4)}".strip()
        args = [] if match is None else [int(g) for g in match.groups()[1:3] if g is not None]
        kind = self._reverse().get(base)
        if kind is None:
            return ColumnType(Kind.OTHER, sql=declared)
        if kind is Kind.DECIMAL:
            if not args:
                # An unconstrained numeric: any precision, scale as given per value.
                return ColumnType(Kind.OTHER, sql=declared)
            return ColumnType(kind, precision=args[0], scale=args[1] if len(args) > 1 else 0)
        if kind is Kind.STRING and args:
            return ColumnType(kind, length=args[0])
        return ColumnType(kind)

    def _reverse(self) -> dict[str, Kind]:
        reverse = {
            re.sub(r"\(.*\)", "", spelling).strip().lower(): kind
            for kind, spelling in self.types.items()
        }
        reverse.update(self.aliases)
        return reverse


POSTGRES = Dialect(
    name="PostgreSQL",
    types={
        Kind.BOOLEAN: "boolean",
        Kind.INT16: "smallint",
        Kind.INT32: "integer",
        Kind.INT64: "bigint",
        Kind.FLOAT32: "real",
        Kind.FLOAT64: "double precision",
        Kind.DECIMAL: "numeric({p},{s})",
        Kind.STRING: "text",
        Kind.BINARY: "bytea",
        Kind.DATE: "date",
        Kind.TIME: "time without time zone",
        Kind.TIMESTAMP: "timestamp without time zone",
        Kind.INSTANT: "timestamp with time zone",
        Kind.INTERVAL: "interval",
        Kind.JSON: "json",
    },
    values={
        Kind.BOOLEAN: "as is",
        Kind.INT16: "as is",
        Kind.INT32: "as is",
        Kind.INT64: "as is",
        Kind.FLOAT32: "as is, NaN and ±Infinity included",
        Kind.FLOAT64: "as is, NaN and ±Infinity included",
        Kind.DECIMAL: "exact",
        Kind.STRING: "as is",
        Kind.BINARY: "as is",
        Kind.DATE: "as is",
        Kind.TIME: "to the microsecond",
        Kind.TIMESTAMP: "the wall-clock value, to the microsecond",
        Kind.INSTANT: "the instant, to the microsecond (shown in the session's zone)",
        Kind.INTERVAL: "the same length, to the microsecond",
        Kind.JSON: "JSON text (see below)",
    },
    aliases={
        "int2": Kind.INT16,
        "int4": Kind.INT32,
        "int8": Kind.INT64,
        "float4": Kind.FLOAT32,
        "float8": Kind.FLOAT64,
        "bool": Kind.BOOLEAN,
        "varchar": Kind.STRING,
        "timestamptz": Kind.INSTANT,
        "decimal": Kind.DECIMAL,
        "character varying": Kind.STRING,
    },
    bounded_string="character varying({n})",
)

SQLITE = Dialect(
    name="SQLite",
    types={
        Kind.BOOLEAN: "BOOLEAN",
        Kind.INT16: "INTEGER",
        Kind.INT32: "INTEGER",
        Kind.INT64: "INTEGER",
        Kind.FLOAT32: "REAL",
        Kind.FLOAT64: "REAL",
        # The name holds TEXT so the column has TEXT affinity: a NUMERIC column would turn
        # '12345678901234567890.5' into a 15-digit REAL.
        Kind.DECIMAL: "DECIMAL_TEXT({p},{s})",
        Kind.STRING: "TEXT",
        Kind.BINARY: "BLOB",
        Kind.DATE: "DATE",
        Kind.TIME: "TIME",
        Kind.TIMESTAMP: "TIMESTAMP",
        Kind.INSTANT: "TIMESTAMPTZ",
        Kind.INTERVAL: "INTERVAL",
        # TEXT affinity too: under "JSON" (NUMERIC affinity) a variant holding a number,
        # '12345678901234567890123.5', would be stored as a 15-digit REAL.
        Kind.JSON: "JSON_TEXT",
    },
    values={
        Kind.BOOLEAN: "integer 1 / 0",
        Kind.INT16: "integer",
        Kind.INT32: "integer",
        Kind.INT64: "integer",
        Kind.FLOAT32: "real (the float's exact value); ±Inf as is; NaN as the text 'NaN'",
        Kind.FLOAT64: "real; ±Inf as is; NaN as the text 'NaN' (SQLite stores a NaN real as NULL)",
        Kind.DECIMAL: "text, exact, plain notation: '12300', '-0.01'",
        Kind.STRING: "text",
        Kind.BINARY: "blob",
        Kind.DATE: "text 'YYYY-MM-DD'",
        Kind.TIME: "text 'HH:MM:SS.ffffff'",
        Kind.TIMESTAMP: "text 'YYYY-MM-DDTHH:MM:SS.ffffff' (no offset)",
        Kind.INSTANT: "text 'YYYY-MM-DDTHH:MM:SS.ffffff+00:00', always in UTC",
        Kind.INTERVAL: "integer microseconds",
        Kind.JSON: "JSON text (see below)",
    },
    # "json": the JSON columns of tables created before JSON_TEXT.
    aliases={"int": Kind.INT64, "bigint": Kind.INT64, "double": Kind.FLOAT64, "json": Kind.JSON},
    bounded_string="TEXT",
)


# -- the documented mapping --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SparkType:
    """A Spark SQL type and the Arrow type Spark hands the data source for it."""

    spark: str
    arrow: pa.DataType
    arrow_text: str = ""
    """How the docs show the Arrow type (default: ``str(arrow)``)."""


SPARK_TYPES: tuple[SparkType, ...] = (
    SparkType("boolean", pa.bool_()),
    SparkType("byte (tinyint)", pa.int8()),
    SparkType("short (smallint)", pa.int16()),
    SparkType("int", pa.int32()),
    SparkType("long (bigint)", pa.int64()),
    SparkType("float", pa.float32()),
    SparkType("double", pa.float64()),
    SparkType("decimal(p,s), p ≤ 38, s < 0 allowed", pa.decimal128(38, 10), "decimal128(p, s)"),
    SparkType("string, char(n), varchar(n)", pa.string()),
    SparkType("binary", pa.binary()),
    SparkType("date", pa.date32()),
    SparkType(
        "timestamp",
        pa.timestamp("us", tz="Etc/UTC"),
        "timestamp[us, tz=<session time zone>]",
    ),
    SparkType("timestamp_ntz", pa.timestamp("us")),
    SparkType("time(p)", pa.time64("ns")),
    SparkType("interval day to second", pa.duration("us")),
    SparkType("array<T>", pa.list_(pa.int32()), "list<T>"),
    SparkType("map<K,V>", pa.map_(pa.string(), pa.int32()), "map<K, V>"),
    SparkType("struct<...>", pa.struct([("x", pa.int32())]), "struct<...>"),
    SparkType(
        "variant",
        pa.struct(
            [
                pa.field("value", pa.binary(), nullable=False),
                pa.field("metadata", pa.binary(), nullable=False, metadata={"variant": "true"}),
            ]
        ),
        "struct<value: binary, metadata: binary>",
    ),
    SparkType("void (NULL literal)", pa.null()),
)
"""Every Spark SQL type ``format("millpond")`` writes. Not writable: ``interval year to
month`` (pyarrow cannot read Arrow month intervals; the data source refuses it up front)."""


def mapping_markdown() -> str:
    """The docs' type table, one row per Spark type."""
    lines = [
        "| Spark type | Arrow type | PostgreSQL column | PostgreSQL value | SQLite column "
        "| SQLite value |",
        "|---|---|---|---|---|---|",
    ]
    for row in SPARK_TYPES:
        column = column_type(row.arrow)
        if column is None:
            cells = ["no column until a batch brings values", "—"] * 2
        else:
            cells = []
            for dialect in (POSTGRES, SQLITE):
                sql = (
                    dialect.types[Kind.DECIMAL].format(p="p", s="s")
                    if column.kind is Kind.DECIMAL
                    else dialect.sql_type(column)
                )
                cells += [f"`{sql}`", dialect.values[column.kind]]
        arrow = f"`{row.arrow_text or row.arrow}`"
        lines.append(f"| {row.spark} | {arrow} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
