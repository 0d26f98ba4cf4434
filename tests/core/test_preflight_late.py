"""``preflight`` does not wait past its timeout for a store that does not answer; a refusal
that comes after the start carried on is logged as an error, never raised."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

from millpond.errors import StoreAccessError
from millpond.storage import ForwardingStore, ObjectInfo, open_store
from millpond.storage.checks import preflight


class _Late(ForwardingStore):
    """A remote-looking store whose listing answers, with a refusal, only once released."""

    def __init__(self) -> None:
        super().__init__(open_store(f"memory://late-{uuid.uuid4().hex}"))
        self.asked = threading.Event()
        self.release = threading.Event()

    @property
    def is_local(self) -> bool:
        return False

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[ObjectInfo]:
        self.asked.set()
        assert self.release.wait(30)
        raise StoreAccessError("listing refused", problem="permission", hint="grant it")


def test_a_refusal_after_the_timeout_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    store = _Late()
    before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING, logger="millpond.storage.checks"):
        assert preflight(store, write=False, timeout=0.05) is None  # carried on without it
        assert store.asked.wait(30)
        (check,) = [
            t for t in set(threading.enumerate()) - before if t.name == "millpond-preflight"
        ]
        assert check.daemon
        store.release.set()
        check.join(30)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages[0][0] == "WARNING"
    assert "did not answer within" in messages[0][1]
    assert messages[1:] == [("ERROR", "store check at start: listing refused; grant it")]
