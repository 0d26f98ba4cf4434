"""What ``format("millpond")`` refuses before a job starts: Spark types Arrow cannot carry.

PySpark hands a Python data source its rows as Arrow batches. For ``interval year to month``
(and the legacy ``CalendarIntervalType``) that conversion fails inside the task, with a
``KeyError: 21`` from pyarrow that names neither the column nor the type. The driver checks the
schema first and names both, with what to do instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from millpond.errors import InvalidInputError

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType

__all__ = ["refuse_unwritable"]


def refuse_unwritable(schema: StructType) -> None:
    """Raise when a column, or anything nested in one, has a type Arrow cannot carry.

    Raises:
        InvalidInputError: naming the column (``a.b[].c`` for nested fields), its type and a
            cast that can be written instead.
    """
    for field in schema.fields:
        _check(field.name, field.dataType)


def _check(path: str, dtype: DataType) -> None:
    from pyspark.sql.types import (
        ArrayType,
        CalendarIntervalType,
        MapType,
        StructType,
        YearMonthIntervalType,
    )

    if isinstance(dtype, YearMonthIntervalType | CalendarIntervalType):
        instead = (
            f"CAST({path} AS INT) for its number of months, or CAST({path} AS STRING)"
            if isinstance(dtype, YearMonthIntervalType)
            else f"CAST({path} AS STRING)"
        )
        raise InvalidInputError(
            f"column {path!r}: Spark type {dtype.simpleString()} cannot be written: PySpark "
            "hands a data source its rows as Arrow, and pyarrow cannot read Arrow month "
            f"intervals; write {instead} instead"
        )
    if isinstance(dtype, StructType):
        for field in dtype.fields:
            _check(f"{path}.{field.name}", field.dataType)
    elif isinstance(dtype, ArrayType):
        _check(f"{path}[]", dtype.elementType)
    elif isinstance(dtype, MapType):
        _check(f"{path}{{key}}", dtype.keyType)
        _check(f"{path}{{value}}", dtype.valueType)
