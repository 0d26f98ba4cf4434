"""The type fidelity matrix without Spark: ``produce_arrow`` -> ``to_arrow()`` exactly, and
the same Arrow tables (as Spark hands them over, in two session zones) into each sink."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from consumer_support import Database

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.sinks.types import POSTGRES, SQLITE, column_type, mapping_markdown
from millpond.formats.arrow import encode_ipc
from millpond.producer import Producer, ProducerConfig
from tests.type_matrix import POSTGRES_TYPES, SQLITE_TYPES, arrow_table, check_database

ZONES = ["Etc/UTC", "America/New_York"]


@pytest.mark.parametrize("zone", ZONES)
def test_produce_arrow_to_arrow_round_trips_exactly(tmp_path: Path, zone: str) -> None:
    table = arrow_table(zone)
    store = f"memory://matrix-{tmp_path.name}-{zone.replace('/', '-')}"
    with Producer(ProducerConfig(store=store, wal_dir=str(tmp_path / "wal"))) as producer:
        producer.produce_arrow(table).wait()
        # Two entries in one batch: to_arrow() unifies them.
        producer.produce_arrow(pa.concat_tables([table, table])).wait()
    with Consumer(ConsumerConfig(store=store, gc_enabled=False)) as consumer:
        consumer.initialize()
        results = []
        while (batch := consumer.next_batch()) is not None:
            results.append(batch.to_arrow())
            consumer.ack(batch.sequence)
    assert [r.num_rows for r in results] == [3, 6]
    for result, expected in zip(results, [table, pa.concat_tables([table, table])], strict=True):
        assert result.schema == expected.schema
        # Byte for byte (NaN payloads included): one record batch each, same IPC bytes.
        assert encode_ipc(result.combine_chunks()) == encode_ipc(expected.combine_chunks())


def test_the_matrix_in_two_zones_lands_as_documented(database: Database) -> None:
    batches = [
        ConsumedBatch(
            entries=tuple(encode_ipc(arrow_table(zone))),
            sequence=sequence,
            location=f"ingest/{sequence:026d}.batch",
        )
        for sequence, zone in enumerate(ZONES)
    ]
    with database.sink() as sink:
        assert sink.write(batches[0])
        assert sink.write(batches[1])
    check_database(database.kind, database.url, database.table, copies=2)


def test_the_docs_show_the_mapping_the_code_applies() -> None:
    """The types page asks for the table, which the site's build makes from mapping_markdown()."""
    page = (Path(__file__).parents[2] / "docs" / "user-guide" / "types.md").read_text()
    assert "\n<!-- millpond:types -->\n" in page
    assert mapping_markdown().startswith("| Spark type | Arrow type |")


def test_the_mapping_declares_the_types_the_matrix_reads_back() -> None:
    """The docs' table comes from the dialects; the matrix checks the reflected types against
    hand-written ones. Both must be the same types."""
    schema = arrow_table("Etc/UTC").schema
    for name, expected in POSTGRES_TYPES.items():
        column = column_type(schema.field(name).type)
        assert column is not None
        assert POSTGRES.sql_type(column) == expected, name
    for name, expected in SQLITE_TYPES.items():
        column = column_type(schema.field(name).type)
        assert column is not None
        assert SQLITE.sql_type(column) == expected, name
