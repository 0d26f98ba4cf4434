"""One value as JSON text, in the conventions every nested value follows (docs/user-guide/types.md).

Decimals are exact numbers, floats are numbers except NaN and ±Infinity (the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``), binary is base64, dates and times are ISO-8601
text (instants in UTC with ``+00:00``), intervals are integer microseconds. Shared by Arrow's
nested values (:mod:`millpond.consumer.sinks._values`) and Spark's variants
(:mod:`millpond.consumer.sinks._variant`), so the two cannot drift apart.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["plain_json", "quoted_strings", "scalar_json"]

_UTC = dt.UTC
# json.dumps(value, ensure_ascii=False) for a str, without building an encoder each time.
_encode_string = json.encoder.encode_basestring
# What json.dumps(ensure_ascii=False) writes for each control character.
_CONTROL = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPES = [(chr(c), _CONTROL.get(chr(c), f"\\u{c:04x}")) for c in range(0x20)]


def scalar_json(value: Any, what: object = "") -> str:
    """``value`` (not a list or a mapping) as JSON text.

    Raises:
        TypeError: a value with no JSON form; ``what`` (its Arrow type) goes in the message.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return '"NaN"'
        if math.isinf(value):
            return '"Infinity"' if value > 0 else '"-Infinity"'
        return repr(value)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, str):
        return _encode_string(value)
    if isinstance(value, bytes | dt.date | dt.time | dt.timedelta):
        return json.dumps(plain_json(value, what))
    raise TypeError(f"no JSON form for {type(value).__name__} values of Arrow type {what}")


def plain_json(value: bytes | dt.date | dt.time | dt.timedelta, what: object = "") -> str | int:
    """The string or integer a binary, date, time or duration value is in JSON.

    Raises:
        TypeError: ``value`` is none of those; ``what`` (its Arrow type) goes in the message.
    """
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            local = value.astimezone(_UTC).replace(tzinfo=None)
            return local.isoformat(timespec="microseconds") + "+00:00"
        return value.isoformat(timespec="microseconds")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dt.time):
        return value.isoformat(timespec="microseconds")
    if isinstance(value, dt.timedelta):
        return (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    raise TypeError(f"no JSON form for {type(value).__name__} values of Arrow type {what}")


def quoted_strings(text: pa.Array) -> pa.Array:
    """A string column as JSON strings, escaped as ``json.dumps(ensure_ascii=False)``
    escapes them (what :func:`scalar_json` writes for each)."""
    text = pc.replace_substring(text, "\\", "\\\\")
    text = pc.replace_substring(text, '"', '\\"')
    if pc.any(pc.match_substring_regex(text, "[\\x00-\\x1f]")).as_py():
        for char, escape in _ESCAPES:
            text = pc.replace_substring(text, char, escape)
    return pc.binary_join_element_wise('"', text, '"', "")
