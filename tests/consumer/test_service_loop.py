"""The consume loop in-process: group commits, falling back on bad data, retries, stopping."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest
from consumer_support import FAST_RETRY, MANIFEST, Database, ForwardingSink, QueueWriter, numbered

from millpond.consumer import ConsumedBatch, Consumer, ConsumerConfig
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.sinks import SinkError
from millpond.errors import ConfigError, FormatError
from millpond.queue import read_manifest
from millpond.storage import ObjectStore, open_store


@pytest.fixture
def store() -> ObjectStore:
    return open_store(f"memory://{uuid.uuid4().hex}")  # memory stores are shared by name


def _consumer(store: ObjectStore, **overrides: Any) -> Consumer:
    options: dict[str, Any] = {"store": store, "gc_enabled": False, "retry": FAST_RETRY}
    options.update(overrides)
    return Consumer(ConsumerConfig(**options))


class CountingSink(ForwardingSink):
    """Wraps a real sink and records how batches were grouped into transactions."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.transactions: list[list[int]] = []

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        self.transactions.append([b.sequence for b in batches])
        return list(self.inner.write_many(batches))


def test_a_backlog_is_written_in_groups_and_drained(store: ObjectStore, database: Database) -> None:
    writer = QueueWriter(store)
    for i in range(30):
        writer.append_arrow(numbered(i * 10, 10))
    sink = CountingSink(database.sink())
    service = ConsumerService(_consumer(store, read_ahead=8), sink, max_group=6)
    stats = service.run(threading.Event(), until_idle=True)
    sink.close()
    assert (stats.batches, stats.rows, stats.last_sequence) == (30, 300, 29)
    assert [s for group in sink.transactions for s in group] == list(range(30))
    assert max(len(group) for group in sink.transactions) > 1
    assert max(len(group) for group in sink.transactions) <= 6
    assert read_manifest(store, MANIFEST).manifest.entries == ()
    assert database.query(f'SELECT count(DISTINCT n), count(*) FROM "{database.table}"') == [
        (300, 300)
    ]


def test_a_bad_batch_in_a_group_stops_after_the_good_ones(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    writer.append_arrow(numbered(10, 10))
    writer.append([b"\xff\xff\xff\xffnot really an arrow stream"])  # fetches fine, rows fail
    writer.append_arrow(numbered(30, 10))
    sink = CountingSink(database.sink())
    service = ConsumerService(_consumer(store, read_ahead=8), sink, max_group=8)
    with pytest.raises(FormatError, match="sequence 2"):
        service.run(threading.Event(), until_idle=True)
    sink.close()
    assert service.stats.last_sequence == 1
    assert database.query(f'SELECT count(*), max(n) FROM "{database.table}"') == [(20, 19)]
    # The good batches were acked and dequeued on the way out; the bad one waits.
    assert [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries] == [2, 3]


class FlakySink(CountingSink):
    """Fails with a transient error ``failures`` times before each real write."""

    def __init__(self, inner: Any, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures
        self.attempts = 0

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        self.attempts += 1
        if self.failures:
            self.failures -= 1
            raise SinkError("database restarting", transient=True)
        return super().write_many(batches)

    def write(self, batch: ConsumedBatch) -> bool:
        return self.write_many([batch])[0]


def test_transient_sink_errors_are_retried(store: ObjectStore, database: Database) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    sink = FlakySink(database.sink(), failures=2)
    service = ConsumerService(
        _consumer(store), sink, retry_initial_delay=0.001, retry_max_delay=0.01
    )
    stats = service.run(threading.Event(), until_idle=True)
    sink.close()
    assert stats.rows == 30
    assert sink.attempts >= 3


def test_stop_while_the_database_is_down_acks_nothing(
    store: ObjectStore, database: Database
) -> None:
    writer = QueueWriter(store)
    writer.append_arrow(numbered(0, 10))
    sink = FlakySink(database.sink(), failures=10**6)
    stop = threading.Event()
    service = ConsumerService(
        _consumer(store), sink, retry_initial_delay=0.001, retry_max_delay=0.01
    )
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    stats = service.run(stop)
    timer.join()
    sink.close()
    assert stats.last_sequence is None
    assert [e.sequence for e in read_manifest(store, MANIFEST).manifest.entries] == [0]


def test_progress_lines_report_rates_and_lag(
    store: ObjectStore, database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append_arrow(numbered(i * 10, 10))
    with (
        caplog.at_level(logging.INFO, logger="millpond.consumer.app.service"),
        database.sink() as sink,
    ):
        ConsumerService(_consumer(store), sink, progress_interval=0.0).run(
            threading.Event(), until_idle=True
        )
    text = caplog.text
    assert "rows (" in text
    assert "lag" in text
    assert "stopped" in text


def test_has_ready_batch_never_blocks(store: ObjectStore) -> None:
    writer = QueueWriter(store)
    for i in range(3):
        writer.append([b"%d" % i])
    with _consumer(store, read_ahead=2) as consumer:
        assert not consumer.has_ready_batch()  # not initialized
        consumer.initialize()
        batch = consumer.next_batch()
        assert batch is not None
        consumer.ack(batch.sequence)
        threading.Event().wait(0.2)  # let the read-ahead finish its fetches
        assert consumer.has_ready_batch()
        while consumer.has_ready_batch():
            batch = consumer.next_batch()
            assert batch is not None
            consumer.ack(batch.sequence)
        assert consumer.next_batch() is None
        assert not consumer.has_ready_batch()


def test_write_many_is_all_or_nothing(database: Database) -> None:
    from millpond.formats.arrow import encode_ipc

    good = ConsumedBatch(
        entries=tuple(encode_ipc(pa.table({"n": [1]}))),
        sequence=0,
        location="ingest/00000000000000000000000000.batch",
    )
    clash = ConsumedBatch(
        entries=tuple(encode_ipc(pa.table({"n": ["text"]}))),
        sequence=1,
        location="ingest/00000000000000000000000001.batch",
    )
    repeat = ConsumedBatch(entries=good.entries, sequence=2, location=good.location)
    with database.sink() as sink:
        with pytest.raises(FormatError, match="unified"):
            sink.write_many([good, clash])
        assert sink.last_sequence("") is None
        assert sink.write_many([good, repeat]) == [True, False]
        assert sink.last_sequence("") == 2
    assert database.query(f'SELECT n FROM "{database.table}"') == [(1,)]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_group", 0),
        ("max_group", -3),
        ("max_group", 2.5),
        ("quarantine_limit", 0),
        ("poll_min", float("nan")),
        ("poll_min", 0.0),
        ("poll_max", float("inf")),
        ("retry_initial_delay", -1.0),
        ("retry_max_delay", float("nan")),
        ("progress_interval", -1.0),
        # Set-aside copies inside the data prefix could not be replayed (replay refuses it);
        # an empty prefix would have fallen back to the default without a word.
        ("dead_letter_prefix", "ingest"),
        ("dead_letter_prefix", "/ingest/"),
        ("dead_letter_prefix", ""),
    ],
)
def test_a_setting_out_of_range_is_refused_by_name(
    store: ObjectStore, database: Database, setting: str, value: object
) -> None:
    # Clamping 0 groups to 1, or sleeping NaN seconds in the loop's first idle poll, would
    # run something other than what the caller asked for, without a word.
    sink = database.sink()
    try:
        with pytest.raises(ConfigError, match=setting):
            ConsumerService(_consumer(store), sink, **{setting: value})
    finally:
        sink.close()
