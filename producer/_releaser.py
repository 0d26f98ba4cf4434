"""Freeing the WAL behind the appends: the ``millpond-wal-releaser`` thread.

A release rewrites the WAL's sidecar, fsyncs it, and deletes the files left with nothing to
publish: 13 ms at the median and 50 ms at p99 on a disk sixteen producers share (measured
through a coordinator at 50 ms of store latency). Done on the committer's thread after every
append, it held the next append back by that much, and the batches uploaded meanwhile with
it. Here it runs beside the appends: the committer says a release is owed, and this thread
releases up to the watermark of that moment or later (everything below it is settled either
way).

A release that lags, or never runs (a crash), only leaves settled records in the WAL: a
producer started on it replays them as uncertain batches, finds them in the manifest, and
settles them without appending them again (``Committer._verify``). After a fatal error nothing
more is released, as before: staged data stays for the next producer.
"""

from __future__ import annotations

import logging

from millpond.errors import StorageError
from millpond.producer._state import State
from millpond.wal import Wal

__all__ = ["Releaser"]

logger = logging.getLogger(__name__)


class Releaser:
    """The body of the ``millpond-wal-releaser`` thread, and the last release at close."""

    def __init__(self, state: State, wal: Wal) -> None:
        self._state = state
        self._wal = wal

    def run(self) -> None:
        while self._owed():
            self._release()

    def finish(self) -> None:
        """Release what the last appends settled, once every thread has stopped (a clean
        close leaves no settled record in its WAL)."""
        with self._state.cond:
            owed = self._state.release_owed and self._state.fatal is None
        if not owed:
            return
        try:
            self._release()
        except StorageError as err:
            logger.warning("%s; its settled records are found published on the next start", err)

    def _owed(self) -> bool:
        """Wait until a release is owed (True) or the producer stops (False)."""
        state = self._state
        with state.cond:
            while not state.release_owed:
                if state.stop.is_set() or state.fatal is not None:
                    return False
                state.release_wake.wait()
            return state.fatal is None

    def _release(self) -> None:
        state = self._state
        with state.cond:
            state.release_owed = False
            watermark = state.watermark(self._wal.next_seq)
        self._wal.release(watermark)
        with state.cond:
            state.space.notify_all()  # the WAL writer may be waiting for space
