"""A producer or consumer used in a process forked from the one that opened it
(``multiprocessing`` with fork, a pre-forking server) is refused at once with what to do.

Before the fix ``produce()`` in the child accepted the entries, no thread there ever wrote
them, and ``wait()`` and ``close()`` never returned; a consumer's child would wait on fetches
no thread makes, or deliver beside its parent under one epoch. The parent goes on unharmed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from millpond.consumer import Consumer, ConsumerConfig
from millpond.producer import Producer
from tests.producer.producer_support import FAST_RETRY, all_entries, config, fresh_memory


def _in_child(calls: dict[str, Callable[[], object]]) -> dict[str, str]:
    """What each call does in a forked child (it reports through a pipe and exits)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        # A call that hangs (on a lock a parent's thread held at the fork) ends the child
        # by SIGALRM (its default action, not pytest-timeout's handler, which would have to
        # run on the hung thread): the parent then reads no report and sees the signal.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(_CHILD_SECONDS)
        outcome: dict[str, str] = {}
        for name, call in calls.items():
            try:
                call()
                outcome[name] = "returned"
            except BaseException as err:  # reported to the parent
                outcome[name] = f"{type(err).__name__}: {err}"
        os.write(write_end, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child hung or failed: status {status}"
    return json.loads(report)  # type: ignore[no-any-return]


_CHILD_SECONDS = 20  # a child's calls are refused at once; this long means one hung


@contextlib.contextmanager
def _held_by_a_thread(lock: threading.Condition | threading.RLock) -> Iterator[None]:
    """``lock`` held by another thread of this process for the duration (as a producer's or
    consumer's background thread holds it at any moment)."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            done.wait(_CHILD_SECONDS * 2)

    thread = threading.Thread(target=hold, name="holds-the-lock")
    thread.start()
    try:
        assert holding.wait(_CHILD_SECONDS)
        yield
    finally:
        done.set()
        thread.join()


def _refused(outcome: dict[str, str], instead: str) -> None:
    for name, text in outcome.items():
        assert text.startswith("ClosedError: "), (name, text)
        assert f"opened in process {os.getpid()}" in text, (name, text)
        assert "forked from it" in text, (name, text)
        assert instead in text, (name, text)


def test_a_forked_child_is_refused_by_the_producer_and_the_parent_goes_on(
    tmp_path: Path,
) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.produce([b"before"]).wait(timeout=30)
        pending = producer.produce([b"made before the fork"])
        outcome = _in_child(
            {
                "produce": lambda: producer.produce([b"child"]).wait(timeout=5),
                "wait on a handle made before the fork": lambda: pending.wait(timeout=5),
                "flush": lambda: producer.flush(timeout=5),
                "close": lambda: producer.close(timeout=5),
            }
        )
        _refused(outcome, "Open a Producer in this process after the fork")
        pending.wait(timeout=30)
        producer.produce([b"after"]).wait(timeout=30)
    assert all_entries(store) == [b"before", b"made before the fork", b"after"]


def test_a_forked_child_is_refused_by_the_consumer_and_the_parent_goes_on(
    tmp_path: Path,
) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        for entry in (b"a", b"b", b"c"):
            producer.produce([entry]).wait(timeout=30)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with consumer:
        consumer.initialize()
        first = consumer.next_batches(1)
        outcome = _in_child(
            {
                "next_batches": lambda: consumer.next_batches(1),
                "ack": lambda: consumer.ack(first[0].sequence),
                "initialize": lambda: consumer.initialize(),
                "close": consumer.close,
            }
        )
        _refused(outcome, "Open a Consumer in this process after the fork")
        consumer.ack(first[0].sequence)
        rest = consumer.next_batches(10)
        assert [e for b in [*first, *rest] for e in b.entries] == [b"a", b"b", b"c"]
        assert consumer.epoch is not None


def test_a_child_forked_while_a_producer_thread_held_its_lock_is_refused_not_hung(
    tmp_path: Path,
) -> None:
    # Before the fix produce() and flush() took the producer's lock before looking at the
    # process: a child forked while a writer or sealer thread held it waited for ever.
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        with _held_by_a_thread(producer._state.cond):
            outcome = _in_child(
                {
                    "produce": lambda: producer.produce([b"child"]),
                    "flush": lambda: producer.flush(timeout=5),
                    "metrics": producer.metrics,
                }
            )
        _refused(outcome, "Open a Producer in this process after the fork")
        producer.produce([b"after"]).wait(timeout=30)
    assert all_entries(store) == [b"after"]


def test_a_scrape_in_a_child_forked_while_a_producer_thread_held_its_lock_shows_no_producer(
    tmp_path: Path,
) -> None:
    # A registry the parent registered the producer in is copied into the child (a worker
    # that serves its own metrics): before the fix its scrape read the producer's counters
    # under the lock a thread of the parent held at the fork, and hung.
    store = fresh_memory()
    registry = CollectorRegistry()
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.register_metrics(registry)
        producer.produce([b"a"]).wait(timeout=30)
        assert b"millpond_producer_entries_total 1.0" in generate_latest(registry)

        def scrape_without_producer() -> None:
            text = generate_latest(registry)
            assert b"millpond_producer_" not in text, text

        with _held_by_a_thread(producer._state.cond):
            outcome = _in_child({"scrape": scrape_without_producer})
        assert outcome == {"scrape": "returned"}
        assert b"millpond_producer_entries_total 1.0" in generate_latest(registry)


def test_a_child_forked_while_a_consumer_thread_held_its_lock_is_refused_not_hung(
    tmp_path: Path,
) -> None:
    # The consumer's backlog mover takes the consumer's lock on a thread of its own.
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.produce([b"a"]).wait(timeout=30)
    consumer = Consumer(ConsumerConfig(store=store, gc_enabled=False, retry=FAST_RETRY))
    with consumer:
        consumer.initialize()
        first = consumer.next_batches(1)
        with _held_by_a_thread(consumer._lock):
            outcome = _in_child(
                {
                    "initialize": lambda: consumer.initialize(),
                    "next_batches": lambda: consumer.next_batches(1),
                    "has_ready_batch": consumer.has_ready_batch,
                    "ack": lambda: consumer.ack(first[0].sequence),
                    "ack_through": lambda: consumer.ack_through(first[0].sequence),
                    "flush": lambda: consumer.flush(),
                    "next_entry": consumer.next_entry,
                    "backlog": consumer.backlog,
                }
            )
        _refused(outcome, "Open a Consumer in this process after the fork")
        consumer.ack(first[0].sequence)
        assert [e for b in first for e in b.entries] == [b"a"]
