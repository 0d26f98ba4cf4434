"""A local server run as one child process on one loopback port: Azurite, fake-gcs-server.

:class:`ChildServer` holds what they share with SeaweedFS's wrapper: a data directory (a temp
dir removed on close, or the caller's, kept), a log file, a free port chosen on the first start
and kept across ``stop()`` / ``start()`` so data and endpoint survive a restart, a retry with a
new port when another process took the chosen one meanwhile, and a stop by the child's own
process group (never by name).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Self

from millpond.localstack._process import (
    LocalServiceError,
    close_at_exit,
    forget_at_exit,
    free_ports,
    log_tail,
    stop_process_group,
)

__all__ = ["ChildServer"]

logger = logging.getLogger(__name__)

_BIND_RETRIES = 3
# What the servers print when their port was taken between choosing it and binding it.
_PORT_TAKEN = ("address already in use", "eaddrinuse")


class ChildServer(ABC):
    """One server process on 127.0.0.1:``port``, in its own process group."""

    name = "server"
    """Names the server in log lines and errors."""

    def __init__(self, *, binary: Path, data_dir: Path | None, temp_prefix: str) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            binary: the executable.
            data_dir: where data and the log go; a new temp dir when ``None`` (removed by
                :meth:`close`; a given directory is kept).
            temp_prefix: prefix of the temp dir's name.
        """
        self._binary = binary
        self._owns_dir = data_dir is None
        self._root = Path(tempfile.mkdtemp(prefix=temp_prefix)) if data_dir is None else data_dir
        self._port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        """How long the last :meth:`start` took, until the server took a write."""

    @property
    def root(self) -> Path:
        """The directory holding ``data/`` and the log."""
        return self._root

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr log."""
        return self._root / "server.log"

    @property
    def port(self) -> int:
        """The port on 127.0.0.1 (0 before the first start)."""
        return self._port

    @property
    def pid(self) -> int | None:
        """PID (and process group) of the running server, or ``None``."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    @abstractmethod
    def command(self) -> list[str]:
        """Return the command line (the port must have been chosen)."""

    @abstractmethod
    def _wait_ready(self, timeout: float) -> None:
        """Wait until the server answers and its bucket or container takes a write.

        Raises:
            LocalServiceError: it did not in time, or the process died.
        """

    def start(self, *, timeout: float = 60.0) -> None:
        """Start the server and wait until it takes a write (creating its bucket first).

        The first start picks a free port (and another one if it was taken meanwhile); later
        starts reuse it and the data directory, so data survives.

        Args:
            timeout: seconds to wait for the server to become writable.

        Raises:
            LocalServiceError: already running, or it did not start (the log tail included).
        """
        if self.running:
            raise LocalServiceError(f"{self.name}: already running (pid {self.pid})")
        began = time.monotonic()
        close_at_exit(self, self.close)
        (self._root / "data").mkdir(parents=True, exist_ok=True)
        fixed_port = self._port != 0
        for attempt in range(1, _BIND_RETRIES + 1):
            if not fixed_port:
                self._port = free_ports(1)[0]
            try:
                self._launch_and_wait(timeout)
                break
            except LocalServiceError:
                tail = log_tail(self.log_path, 100).lower()
                self._terminate(timeout=0.0)
                taken = any(text in tail for text in _PORT_TAKEN)
                if fixed_port or not taken or attempt == _BIND_RETRIES:
                    raise
                logger.info("%s: port %s was taken meanwhile; retrying", self.name, self._port)
        self.startup_seconds = time.monotonic() - began
        logger.info(
            "%s (pid %s) on 127.0.0.1:%s, ready in %.1f s",
            self.name,
            self.pid,
            self._port,
            self.startup_seconds,
        )

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop the process group and keep the data: SIGTERM, SIGKILL after ``timeout``.

        Args:
            timeout: seconds between SIGTERM and SIGKILL; 0 kills at once.
        """
        self._terminate(timeout=timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Stop the server and delete the data directory if this object created it.

        Args:
            timeout: seconds between SIGTERM and SIGKILL; by default 0 when the data is about
                to be deleted anyway, else 5.
        """
        if timeout is None:
            timeout = 0.0 if self._owns_dir else 5.0
        self._terminate(timeout=timeout)
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)
        forget_at_exit(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"{type(self).__name__}(port={self._port}, root={str(self._root)!r}, {state})"

    def _launch_and_wait(self, timeout: float) -> None:
        argv = self.command()
        logger.debug("starting %s: %s", self.name, " ".join(argv))
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                argv,
                cwd=self._root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # its own group, so stop() can signal every child it forks
            )
        try:
            self._wait_ready(timeout)
        except Exception as err:
            raise LocalServiceError(
                f"{self.name} did not start: {err}\n--- {self.log_path} (tail) ---\n"
                f"{log_tail(self.log_path)}"
            ) from err

    def _exit_reason(self) -> str | None:
        if self._process is None or self._process.poll() is None:
            return None
        return f"{self._binary.name} exited with code {self._process.returncode}"

    def _terminate(self, *, timeout: float) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_process_group(process, timeout=timeout, name=self.name)
