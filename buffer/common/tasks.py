"""One shape for every background loop: a named daemon thread running a body once.

A :class:`BackgroundTask` owns the thread, its stop event, its join and the error that ended
it. The body stops by returning: it looks at :attr:`~BackgroundTask.stopping`, or pauses in
:meth:`~BackgroundTask.wait` (which ends as soon as a stop is asked), and then finishes what it
is doing (the pass or the write under way: draining) before it returns. :meth:`stop` only
asks, and joins unless told not to; a body that waits on something else (a condition of its
own) is woken by whoever stops it. A caller that holds a lock the body may be waiting for
asks with ``stop(join=False)``: joining there would wait for ever.

What ends a body by raising is kept in :attr:`~BackgroundTask.error` and reported once: to
``on_error`` when one is given (it logs, and does what the failure calls for: a coordinator
refuses what waits, a caller re-raises it), else the thread ends with it as any thread does
(``threading.excepthook`` prints it, and a test sees it).

Threads do not survive ``os.fork()``: in a forked child a task is not running and a join
returns at once (:mod:`millpond.common.forks`). ``threading`` is used through the module
(``threading.Thread``, ``threading.Event``), never through names imported from it, so that the
whole-system checker's runtime (``tests/system``) schedules these threads as it does every
other thread of millpond.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self

__all__ = ["BackgroundTask"]


class BackgroundTask:
    """``body`` on a daemon thread named ``name``, started once by :meth:`start`.

    ``stop`` is the event :meth:`stop` sets (default: one of the task's own; a shared one
    stops several tasks at once). ``on_error``, when given, is called on the task's thread
    with what ended the body by raising (module docstring). Its owner starts and stops it:
    the methods are not meant for two callers at once. A subclass's own names stay clear of
    the task's (``_task_*``).
    """

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
        """Start the thread; a task already started is left as it is. Returns ``self``."""
        if self._task_thread is None:
            self._task_thread = threading.Thread(
                target=self._task_main, name=self.name, daemon=True
            )
            self._task_thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the body is running (started and not yet ended)."""
        return self._task_thread is not None and self._task_thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked: the body finishes what it is doing and returns."""
        return self._task_stop.is_set()

    def wait(self, seconds: float | None) -> bool:
        """The body's pause: ``seconds`` (``None``: until a stop), or less when a stop is
        asked. Whether a stop was asked."""
        return self._task_stop.wait(seconds)

    def stop(self, *, join: bool = True, timeout: float | None = None) -> bool:
        """Ask the body to stop; with ``join``, wait for it (at most ``timeout`` seconds).
        Whether it has ended (:meth:`join`)."""
        self._task_stop.set()
        return self.join(timeout) if join else not self.running

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds (``None``: as long as it takes) for the body to
        end; whether it has. A task never started has nothing to wait for; on the task's own
        thread this returns ``False`` at once (the body cannot wait for itself)."""
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
