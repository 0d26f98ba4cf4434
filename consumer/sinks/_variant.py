"""Spark ``VARIANT`` values as JSON text.

Spark hands a variant column to Arrow as ``struct<value: binary, metadata: binary>`` whose
``metadata`` child carries the field metadata ``variant: true``: the value in the binary
Variant encoding (Apache Parquet, ``VariantEncoding.md``) and the dictionary of its object
keys. Written as that struct, a database would get two base64 blobs; a user who wrote
``parse_json('{"a": 1}')`` expects ``{"a":1}``. This module decodes the encoding into JSON
text, written by the same :func:`~millpond.consumer.sinks._json.scalar_json` as the other
nested values (decimals exact, NaN and ±Infinity as strings, binary base64, dates and times
ISO-8601 with instants in UTC); UUIDs are their canonical text. Object keys come in the
order the encoding keeps them (sorted by key, as Spark's ``to_json`` writes them).

``ConsumedBatch.to_arrow()`` is untouched: it hands back the struct exactly as Spark wrote it.
"""

from __future__ import annotations

import datetime as dt
import functools
import struct
import uuid
from collections.abc import Sequence
from decimal import Context, Decimal
from typing import Any

import pyarrow as pa

from millpond.consumer.sinks._json import scalar_json
from millpond.errors import FormatError

__all__ = ["is_variant", "json_keys", "variant_json"]

_UTC = dt.UTC
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_DAY = dt.date(1970, 1, 1)
_VERSION = 1
_EXACT = Context(prec=80)  # a 16-byte decimal has at most 39 digits: never rounded
# basic types (the low two bits of a value's first byte)
_PRIMITIVE, _SHORT_STRING, _OBJECT, _ARRAY = range(4)


def is_variant(dtype: pa.DataType) -> bool:
    """Whether ``dtype`` is how Spark hands a ``VARIANT`` column to Arrow."""
    if not pa.types.is_struct(dtype) or dtype.num_fields != 2:
        return False
    value, metadata = dtype.field(0), dtype.field(1)
    return (
        value.name == "value"
        and metadata.name == "metadata"
        and pa.types.is_binary(value.type)
        and pa.types.is_binary(metadata.type)
        and (metadata.metadata or {}).get(b"variant") == b"true"
    )


def variant_json(value: bytes, metadata: bytes) -> str:
    """One variant as compact JSON text.

    Raises:
        FormatError: the bytes are not a variant this decoder knows (naming the byte offset).
    """
    keys = json_keys(metadata)
    out: list[str] = []
    _write(memoryview(value), 0, keys, out)
    return "".join(out)


def json_keys(metadata: bytes) -> tuple[str, ...]:
    """The keys of a variant's dictionary as JSON strings, by key id.

    Raises:
        FormatError: the bytes are not a dictionary this decoder knows.
    """
    return _json_keys(metadata) if len(metadata) <= _CACHED_METADATA else _keys(metadata)


_CACHED_METADATA = 4096  # bytes: a column's rows mostly share a few small dictionaries


@functools.lru_cache(maxsize=256)
def _json_keys(metadata: bytes) -> tuple[str, ...]:
    """The dictionary's keys as JSON strings, decoded once for every row that shares it."""
    return _keys(metadata)


def _keys(metadata: bytes) -> tuple[str, ...]:
    if not metadata:
        raise FormatError("variant metadata: expected a header byte, found none")
    header = metadata[0]
    if header & 0x0F != _VERSION:
        raise FormatError(
            f"variant metadata: version at byte 0: expected {_VERSION}, found {header & 0x0F}"
        )
    size = (header >> 6) + 1
    count = _uint(metadata, 1, size)
    offsets_at = 1 + size
    strings_at = offsets_at + (count + 1) * size
    offsets = [_uint(metadata, offsets_at + i * size, size) for i in range(count + 1)]
    end = strings_at + offsets[-1]
    if end > len(metadata):
        raise FormatError(f"variant metadata: expected {end} bytes, found {len(metadata)}")
    keys = (metadata[strings_at + offsets[i] : strings_at + offsets[i + 1]] for i in range(count))
    return tuple(scalar_json(bytes(key).decode("utf-8")) for key in keys)


def _write(data: memoryview, at: int, keys: tuple[str, ...], out: list[str]) -> None:
    if at >= len(data):
        raise FormatError(f"variant value: expected a header at byte {at}, found the end")
    header = data[at]
    basic, rest = header & 0x03, header >> 2
    if basic == _SHORT_STRING:
        out.append(scalar_json(_string(bytes(data[at + 1 : at + 1 + rest]), at)))
    elif basic == _OBJECT:
        _write_object(data, at, rest, keys, out)
    elif basic == _ARRAY:
        _write_array(data, at, rest, keys, out)
    elif rest in _INTS:  # the commonest primitives, written without a Python value between
        out.append(str(_int(data, at + 1, _INTS[rest])))
    elif rest in _LITERALS:
        out.append(_LITERALS[rest])
    else:
        out.append(scalar_json(_primitive(data, at, rest)))


def _write_object(
    data: memoryview, at: int, rest: int, keys: tuple[str, ...], out: list[str]
) -> None:
    offset_size = (rest & 0x03) + 1
    id_size = ((rest >> 2) & 0x03) + 1
    count_size = 4 if (rest >> 4) & 0x01 else 1
    count = _uint(data, at + 1, count_size)
    ids_at = at + 1 + count_size
    offsets_at = ids_at + count * id_size
    values_at = offsets_at + (count + 1) * offset_size
    ids = _uints(data, ids_at, id_size, count)
    offsets = _uints(data, offsets_at, offset_size, count)
    out.append("{")
    for i, key_id in enumerate(ids):
        if key_id >= len(keys):
            raise FormatError(
                f"variant value: field id at byte {ids_at + i * id_size}: expected below "
                f"{len(keys)}, found {key_id}"
            )
        if i:
            out.append(",")
        out.append(keys[key_id])
        out.append(":")
        _write(data, values_at + offsets[i], keys, out)
    out.append("}")


def _write_array(
    data: memoryview, at: int, rest: int, keys: tuple[str, ...], out: list[str]
) -> None:
    offset_size = (rest & 0x03) + 1
    count_size = 4 if (rest >> 2) & 0x01 else 1
    count = _uint(data, at + 1, count_size)
    offsets_at = at + 1 + count_size
    values_at = offsets_at + (count + 1) * offset_size
    out.append("[")
    for i, offset in enumerate(_uints(data, offsets_at, offset_size, count)):
        if i:
            out.append(",")
        _write(data, values_at + offset, keys, out)
    out.append("]")


def _uints(data: memoryview, at: int, size: int, count: int) -> Sequence[int]:
    """``count`` unsigned little-endian integers of ``size`` bytes from ``at``."""
    end = at + size * count
    if end > len(data):
        raise FormatError(f"variant: expected {end - at} bytes at byte {at}, found the end")
    if size == 1:
        return data[at:end]  # a memoryview of bytes: its items are the integers
    return [int.from_bytes(data[i : i + size], "little") for i in range(at, end, size)]


def _primitive(data: memoryview, at: int, type_id: int) -> Any:
    """The primitive at ``at`` as the Python value :func:`scalar_json` writes."""
    body = at + 1
    if type_id == 0:
        return None
    if type_id in (1, 2):
        return type_id == 1
    if type_id in _INTS:
        return _int(data, body, _INTS[type_id])
    if type_id == 7:
        return _unpack("<d", data, body)
    if type_id == 14:
        return _unpack("<f", data, body)
    if type_id in _DECIMALS:
        scale = data[body]
        unscaled = _int(data, body + 1, _DECIMALS[type_id])
        return Decimal(unscaled).scaleb(-scale, _EXACT)
    if type_id == 11:
        return _EPOCH_DAY + dt.timedelta(days=_int(data, body, 4))
    if type_id in (12, 13):
        moment = _EPOCH + dt.timedelta(microseconds=_int(data, body, 8))
        return moment.replace(tzinfo=_UTC) if type_id == 12 else moment
    if type_id in (18, 19):
        # Python's datetime stops at microseconds: the ISO text, nanoseconds appended.
        ticks = _int(data, body, 8)
        text = (_EPOCH + dt.timedelta(microseconds=ticks // 1000)).isoformat(
            timespec="microseconds"
        )
        return f"{text}{ticks % 1000:03d}" + ("+00:00" if type_id == 18 else "")
    if type_id == 17:
        return (_EPOCH + dt.timedelta(microseconds=_int(data, body, 8))).time()
    if type_id == 15:
        size = _uint(data, body, 4)
        return bytes(data[body + 4 : body + 4 + size])
    if type_id == 16:
        size = _uint(data, body, 4)
        return _string(bytes(data[body + 4 : body + 4 + size]), at)
    if type_id == 20:
        return str(uuid.UUID(bytes=bytes(data[body : body + 16])))
    raise FormatError(f"variant value: primitive type at byte {at}: unknown id {type_id}")


_INTS = {3: 1, 4: 2, 5: 4, 6: 8}
_LITERALS = {0: "null", 1: "true", 2: "false"}
_DECIMALS = {8: 4, 9: 8, 10: 16}


def _string(raw: bytes, at: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FormatError(f"variant value: string at byte {at}: not UTF-8 ({err})") from err


def _uint(data: bytes | memoryview, at: int, size: int) -> int:
    if at + size > len(data):
        raise FormatError(f"variant: expected {size} bytes at byte {at}, found the end")
    if size == 1:
        return data[at]
    return int.from_bytes(data[at : at + size], "little")


def _int(data: bytes | memoryview, at: int, size: int) -> int:
    if at + size > len(data):
        raise FormatError(f"variant: expected {size} bytes at byte {at}, found the end")
    return int.from_bytes(data[at : at + size], "little", signed=True)


def _unpack(fmt: str, data: memoryview, at: int) -> float:
    size = struct.calcsize(fmt)
    if at + size > len(data):
        raise FormatError(f"variant: expected {size} bytes at byte {at}, found the end")
    (value,) = struct.unpack_from(fmt, data, at)
    return float(value)
