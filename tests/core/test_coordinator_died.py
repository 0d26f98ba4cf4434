"""The append coordinator's round thread dies of something unexpected: what it held gets no
reply (its clients look in the manifest themselves), every later request is refused, and the
death is logged once."""

from __future__ import annotations

import logging
import uuid

import pytest

from millpond.coordinator.rounds import AppendCoordinator
from millpond.storage import ForwardingStore, GetResult, ObjectStore, open_store
from tests.core._helpers import MANIFEST, pending

DEADLINE = 30.0


class _Broken(ForwardingStore):
    """A store whose reads fail with an error no retry expects (a bug, not an outage)."""

    def get(self, path: str) -> GetResult:
        raise RuntimeError("a bug in the store adapter")


def test_a_round_thread_that_dies_refuses_every_later_request_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store: ObjectStore = _Broken(open_store(f"memory://died-{uuid.uuid4().hex}"))
    coordinator = AppendCoordinator(store, MANIFEST, data_path_prefix="ingest")
    with caplog.at_level(logging.ERROR, logger="millpond.coordinator.rounds"):
        coordinator.start()
        try:
            first = coordinator.submit("first", pending(1))
            assert first.done.wait(DEADLINE)
            assert first.outcome is None  # in the round that died: no reply, "unknown"
            assert isinstance(coordinator.dead, RuntimeError)
            later = coordinator.submit("later", pending(1))
            assert later.done.is_set()
            assert later.outcome is not None
            assert later.outcome.status == "refused", later.outcome
        finally:
            coordinator.stop(DEADLINE)
    died = [r for r in caplog.records if "stopped" in r.getMessage()]
    assert [r.exc_info[1] if r.exc_info else None for r in died] == [coordinator.dead]
