"""Objects whose background threads live in the process that opened them.

``os.fork()`` copies an object into the child but not its threads: a producer there would
accept entries that no thread ever writes, and a consumer would wait on fetches no thread
makes (or deliver beside its parent under one epoch). Such an object records its process
and refuses every call from another one, saying what to do instead.
"""

from __future__ import annotations

import os

from millpond.errors import ClosedError

__all__ = ["OwnProcess"]


class OwnProcess:
    """The process that opened an object; :meth:`check` refuses calls from any other."""

    __slots__ = ("_instead", "_pid", "_what")

    def __init__(self, what: str, instead: str) -> None:
        """Record the calling process as the owner.

        Args:
            what: names the object in the error (``"producer on s3://b/q"``).
            instead: what to do in the child (``"Open a Producer in this process ..."``).
        """
        self._pid = os.getpid()
        self._what = what
        self._instead = instead

    def is_current(self) -> bool:
        """Whether the calling process is the owner (for what must not raise, as a metrics
        scrape, which in a child shows nothing of the parent's object)."""
        return os.getpid() == self._pid

    def check(self) -> None:
        """Raise :class:`ClosedError` when called from a process forked from the owner."""
        pid = os.getpid()
        if pid != self._pid:
            raise ClosedError(
                f"{self._what} was opened in process {self._pid} and this is process {pid}, "
                f"forked from it: its background threads did not survive the fork. "
                f"{self._instead}"
            )
