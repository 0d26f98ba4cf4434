"""A producer used in a process forked from the one that opened it (``multiprocessing`` with
fork, a pre-forking server) is refused at once with what to do. Before the fix ``produce()``
accepted the entries, no thread in the child ever wrote them, and ``wait()`` never returned;
``close()`` waited forever too. The parent's producer goes on unharmed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from millpond.producer import Producer
from tests.producer.producer_support import all_entries, config, fresh_memory


def _in_child(producer: Producer) -> dict[str, str]:
    """What each call does in a forked child (it reports through a pipe and exits)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        outcome: dict[str, str] = {}
        for name, call in (
            ("produce", lambda: producer.produce([b"child"]).wait(timeout=5)),
            ("flush", lambda: producer.flush(timeout=5)),
            ("close", lambda: producer.close(timeout=5)),
        ):
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
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(report)  # type: ignore[no-any-return]


def test_a_forked_child_is_refused_and_the_parent_goes_on(tmp_path: Path) -> None:
    store = fresh_memory()
    with Producer(config(store, tmp_path / "wal")) as producer:
        producer.produce([b"before"]).wait(timeout=30)
        outcome = _in_child(producer)
        for name in ("produce", "flush", "close"):
            assert outcome[name].startswith("ClosedError: "), (name, outcome[name])
            assert f"opened in process {os.getpid()}" in outcome[name]
            assert "forked from it" in outcome[name]
            assert "Open a Producer in this process after the fork" in outcome[name]
        producer.produce([b"after"]).wait(timeout=30)
    assert all_entries(store) == [b"before", b"after"]
