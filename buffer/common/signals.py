"""Stopping a long-running command on SIGTERM or SIGINT without deadlocking it.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread is inside ``threading.Event.wait()`` holding the event's internal (non-reentrant) lock:
a handler that calls ``Event.set()`` then waits for a lock its own thread holds, forever. The
handler here hands ``set()`` to a short-lived thread instead, which takes the lock as soon as
the main thread's ``wait()`` releases it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["stop_on_signals"]

logger = logging.getLogger(__name__)


@contextmanager
def stop_on_signals(stop: threading.Event, *, what: str | None = None) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT set ``stop`` (only in the main thread: elsewhere
    signals cannot be handled, and this does nothing); ``what`` is logged with the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        del frame
        if what is not None:
            logger.info("received %s; %s", signal.Signals(signum).name, what)
        threading.Thread(target=stop.set, name="millpond-stop", daemon=True).start()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
