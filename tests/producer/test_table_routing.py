"""Issue 46: a producer names the table its rows go to; the name travels in the metadata item.

``produce(..., table=)`` / ``produce_arrow(..., table=)`` put a ``millpond.table=<name>`` line in
front of the call's metadata payload (:mod:`millpond.formats.routing`), which an RFC peer can
write too; a payload without it is the application's own, unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from millpond import InvalidInputError
from millpond.errors import FormatError
from millpond.formats.routing import split_table, with_table
from millpond.producer import Producer
from tests.producer.producer_support import config, fresh_memory, read_back


def test_produce_arrow_names_the_table_in_the_metadata_item(tmp_path: Path) -> None:
    store = fresh_memory()
    orders = pa.table({"order_id": [1, 2], "total": [9.5, 3.0]})
    with Producer(config(store, tmp_path, flush_interval=3600.0)) as producer:
        producer.produce_arrow(orders, metadata=b"source=a", table="orders")
        producer.produce_arrow(orders, table="analytics.customers")
        producer.produce([b"plain"], metadata=b"source=b")
        producer.flush(timeout=10)
    [batch] = read_back(store)  # one batch: three calls, three items
    assert [item.start_index for item in batch.metadata] == [0, 1, 2]
    payloads = [item.payload for item in batch.metadata]
    assert payloads == [
        b"millpond.table=orders\nsource=a",
        b"millpond.table=analytics.customers\n",
        b"source=b",
    ]
    assert [split_table(p) for p in payloads] == [
        ("orders", b"source=a"),
        ("analytics.customers", b""),
        (None, b"source=b"),
    ]


def test_a_bad_table_is_refused_before_anything_is_staged(tmp_path: Path) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path)) as producer:
        for bad in ("", "orders;drop", "a.b.c", "1orders", "or ders", "x" * 301):
            with pytest.raises(InvalidInputError, match="table"):
                producer.produce([b"x"], table=bad)
        with pytest.raises(InvalidInputError, match="names a table"):
            producer.produce([b"x"], metadata=b"millpond.table=a\n", table="b")
        with pytest.raises(InvalidInputError, match="metadata"):
            producer.produce([b"x"], metadata="text", table="b")  # type: ignore[arg-type]
        producer.flush(timeout=10)
    assert read_back(store) == []


def test_the_table_line_as_an_rfc_peer_writes_it() -> None:
    assert with_table(b"{}", '"Sales"."Orders"') == b'millpond.table="Sales"."Orders"\n{}'
    # No newline: the line is the whole payload.
    assert split_table(b"millpond.table=orders") == ("orders", b"")
    # Only a payload that begins with the line names a table.
    assert split_table(b"x millpond.table=orders\n") == (None, b"x millpond.table=orders\n")
    assert split_table(b"millpond.tables=x\n") == (None, b"millpond.tables=x\n")
    assert split_table(b"") == (None, b"")


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"millpond.table=\nrest", "empty"),
        (b"millpond.table=a b\n", "not a table name"),
        (b"millpond.table=\xff\n", "UTF-8"),
        (b"millpond.table=a\nmillpond.table=b\n", "two millpond.table lines"),
        (b"millpond.table=a\nmillpond.table=a\n", "two millpond.table lines"),
    ],
)
def test_a_bad_table_line_is_a_format_error(payload: bytes, why: str) -> None:
    with pytest.raises(FormatError, match=why):
        split_table(payload, name="ingest/x.batch")
