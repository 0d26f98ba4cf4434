"""One shape for the background loops: :class:`BackgroundTask`, a named daemon thread running
a body once, with its stop event, its join and the error that ended it.

The body stops by returning: it looks at ``stopping`` or pauses in ``wait()``, which a stop cuts
short, and first finishes what it is doing (draining). ``stop()`` asks, then joins; a caller
holding a lock the body may be waiting for asks with ``stop(join=False)``. What ends a body by
raising is kept in ``error`` and reported once: to ``on_error`` when given, else the thread ends
with it as any thread does (``threading.excepthook``; a test sees it). ``threading`` is used
through the module, so the whole-system checker's runtime (``tests/system``) schedules these
threads too. A forked child has none of them (:mod:`millpond.common.forks`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self

__all__ = ["BackgroundTask"]


class BackgroundTask:
    """``body`` on a daemon thread ``name``; ``stop``: the event :meth:`stop` sets (a shared one
    stops several tasks). Its owner starts and stops it; its own names are ``_task_*``, clear of
    a subclass's."""

    def __init__(
        self,
        name: str,
        body: Callable[[], object],
        *,
        stop: threading.Event | None = None,
        on_error: Callable[[BaseException], object] | None = None,
    ) -> None:
        self.name = name
        self._task_body = body
        self._task_stop = stop if stop is not None else threading.Event()
        self._task_on_error = on_error
        self._task_thread: threading.Thread | None = None  # made by start()
        self.error: BaseException | None = None
        """What ended the body by raising, once it has."""

    def start(self) -> Self:
        """Start the thread, once (later calls do nothing); returns ``self``."""
        if self._task_thread is None:
            self._task_thread = threading.Thread(
                target=self._task_main, name=self.name, daemon=True
            )
            self._task_thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._task_thread is not None and self._task_thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._task_stop.is_set()

    def wait(self, seconds: float | None) -> bool:
        """The body's pause (``None``: until a stop); whether a stop cut it short."""
        return self._task_stop.wait(seconds)

    def stop(self, *, join: bool = True, timeout: float | None = None) -> bool:
        """Ask the body to stop and, with ``join``, :meth:`join`; whether it has ended."""
        self._task_stop.set()
        return self.join(timeout) if join else not self.running

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for the body to end; whether it has. At once when
        never started, and on the task's own thread (``False``: it cannot wait for itself)."""
        thread = self._task_thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    def _task_main(self) -> None:
        try:
            self._task_body()
        except BaseException as err:
            self.error = err
            if self._task_on_error is None:
                raise
            self._task_on_error(err)
