"""A local server run as one child process on loopback ports: SeaweedFS, Azurite,
fake-gcs-server, PostgreSQL.

:class:`ChildProcess` is the process lifecycle they all share, written once: free ports on
127.0.0.1 (new ones when another process took one between choosing and binding it), a launch
into the server's own process group with its output in a log file, a wait until it is usable
that gives up as soon as the process dies, an error carrying the log tail when it does not
start, a stop of the child's own process group (never by name), an exit hook that closes a
server its creator forgot, and ``with``-block use.

:class:`ChildServer` adds the data directory of the storage emulators: a temp dir removed on
close, or the caller's, kept; ports are chosen on the first start and kept across
``stop()`` / ``start()`` so data and endpoint survive a restart. PostgreSQL keeps its own
policy (a fresh cluster in a fresh temp dir per start, removed on stop).
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from millpond.localstack._process import (
    LOOPBACK,
    Closing,
    LocalServiceError,
    StoreEndpoint,
    close_at_exit,
    forget_at_exit,
    free_ports,
    log_tail,
    stop_process_group,
    wait_for,
)

__all__ = ["ChildProcess", "ChildServer", "start_or_close"]

logger = logging.getLogger(__name__)

_BIND_RETRIES = 3
# What the servers print when their port was taken between choosing it and binding it
# (Node's code, and the OS message that Go programs and PostgreSQL print).
_PORT_TAKEN = ("address already in use", "eaddrinuse")
# How much of the log to search for that: `weed server` logs a lot from its four services.
_PORT_TAKEN_TAIL_LINES = 200


class ChildProcess(Closing, ABC):
    """One server process listening on 127.0.0.1, in its own process group."""

    name: ClassVar[str] = "server"
    """Names the server in log lines and errors."""
    log_name: ClassVar[str] = "server.log"
    """The log file's name in :attr:`_workdir`."""
    port_names: ClassVar[tuple[str, ...]] = ("port",)
    """One name per listener that needs a port; the first is :attr:`port`."""
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    """The polite request to stop, sent to the process group before SIGKILL."""

    def __init__(self, *, binary: Path) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            binary: the executable.
        """
        self._binary = binary
        self._ports: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        """The (first) port on 127.0.0.1; 0 before the first start."""
        return self._ports.get(self.port_names[0], 0)

    @property
    def ports(self) -> dict[str, int]:
        """Every TCP port by listener name (empty before the first start)."""
        return dict(self._ports)

    @property
    def pid(self) -> int | None:
        """PID (and process group ID) of the running server, or ``None``."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    @abstractmethod
    def _workdir(self) -> Path:
        """The directory the server runs in and logs to; exists once :meth:`_prepare` ran."""

    @abstractmethod
    def command(self) -> list[str]:
        """Return the command line (the ports must have been chosen)."""

    @abstractmethod
    def _wait_ready(self, timeout: float) -> None:
        """Wait until the server is ready for use (its bucket, container or database exists).

        Raises:
            LocalServiceError: it was not in time, or the process died.
        """

    @abstractmethod
    def close(self, *, timeout: float | None = None) -> None:
        """Stop the server and remove what this object created; safe to call twice."""

    @abstractmethod
    def _prepare(self) -> None:
        """Make the working directory ready before a launch (once per :meth:`start`)."""

    def _popen_options(self) -> dict[str, Any]:
        """Return further :class:`subprocess.Popen` arguments (environment, user)."""
        return {}

    def start(self, *, timeout: float = 60.0) -> None:
        """Start the server and wait until it is ready for use.

        Ports already chosen are kept (a restart); otherwise free ones are picked, and new ones
        when another process took one before the server bound it.

        Args:
            timeout: seconds to wait for the server to become ready.

        Raises:
            LocalServiceError: already running, or it did not start (the log tail included).
        """
        if self.running:
            raise LocalServiceError(f"{self.name}: already running (pid {self.pid})")
        began = time.monotonic()
        close_at_exit(self, self.close)
        self._prepare()
        fixed_ports = bool(self._ports)
        for attempt in range(1, _BIND_RETRIES + 1):
            if not fixed_ports:
                chosen = free_ports(len(self.port_names))
                self._ports = dict(zip(self.port_names, chosen, strict=True))
            try:
                self._launch_and_wait(timeout)
                break
            except LocalServiceError:
                tail = log_tail(self._log_file, _PORT_TAKEN_TAIL_LINES).lower()
                self._terminate(timeout=0.0)
                taken = any(text in tail for text in _PORT_TAKEN)
                if fixed_ports or not taken or attempt == _BIND_RETRIES:
                    raise
                logger.info("%s: a port was taken meanwhile; retrying with new ports", self.name)
        logger.info(
            "%s (pid %s) on %s:%s, ready in %.1f s",
            self.name,
            self.pid,
            LOOPBACK,
            self.port,
            time.monotonic() - began,
        )

    @property
    def _log_file(self) -> Path:
        return self._workdir / self.log_name

    def _launch_and_wait(self, timeout: float) -> None:
        argv = self.command()
        logger.debug("starting %s: %s", self.name, " ".join(argv))
        with self._log_file.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                argv,
                cwd=self._workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # its own group, so stop() can signal every child it forks
                **self._popen_options(),
            )
        try:
            self._wait_ready(timeout)
        except Exception as err:
            raise LocalServiceError(
                f"{self.name} did not start: {err}\n--- {self._log_file} (tail) ---\n"
                f"{log_tail(self._log_file)}"
            ) from err

    def _exit_reason(self) -> str | None:
        if self._process is None or self._process.poll() is None:
            return None
        return f"{self._binary.name} exited with code {self._process.returncode}"

    def _terminate(self, *, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        stop_process_group(process, timeout=timeout, name=self.name, first_signal=self.stop_signal)


class ChildServer(ChildProcess):
    """A storage emulator's process with a data directory that outlives ``stop()``."""

    def __init__(self, *, binary: Path, data_dir: Path | None, temp_prefix: str) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            binary: the executable.
            data_dir: where data and the log go; a new temp dir when ``None`` (removed by
                :meth:`close`; a given directory is kept).
            temp_prefix: prefix of the temp dir's name.
        """
        super().__init__(binary=binary)
        self._owns_dir = data_dir is None
        self._root = (
            Path(tempfile.mkdtemp(prefix=temp_prefix)) if data_dir is None else Path(data_dir)
        )

    @property
    def root(self) -> Path:
        """The directory holding ``data/`` and the log."""
        return self._root

    _workdir = root  # the server runs in it

    def _prepare(self) -> None:
        (self._root / "data").mkdir(parents=True, exist_ok=True)

    def _wait_writable(self, endpoint: StoreEndpoint, *, timeout: float, what: str) -> None:
        """Wait until the endpoint takes a write, a read and a delete through millpond's store.

        Raises:
            LocalServiceError: it did not in time, or the process died.
        """
        from millpond.storage import open_store

        store = open_store(
            endpoint.url_for(f".localstack-probe-{uuid.uuid4().hex}"), endpoint.store_options()
        )

        def probe() -> bool:
            store.put("probe", b"probe")
            body = store.get("probe").data
            store.delete_many(["probe"])
            if body != b"probe":
                raise LocalServiceError(f"{self.name}: read back {body!r}, expected b'probe'")
            return True

        wait_for(probe, timeout=timeout, what=what, alive=self._exit_reason)

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
                to be deleted anyway (a graceful shutdown would only cost time), else 5.
        """
        if timeout is None:
            timeout = 0.0 if self._owns_dir else 5.0
        self._terminate(timeout=timeout)
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)
        forget_at_exit(self)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"{type(self).__name__}(port={self.port}, root={str(self._root)!r}, {state})"


_Server = TypeVar("_Server", bound=ChildProcess)


def start_or_close(server: _Server, *, timeout: float) -> _Server:
    """Start a new server; close it (process and temp dir) if that fails or is interrupted.

    Args:
        server: a server that has not run yet.
        timeout: seconds to wait for it to become ready.

    Returns:
        ``server``, running.

    Raises:
        LocalServiceError: it did not start (the log tail included).
    """
    try:
        server.start(timeout=timeout)
    except BaseException:
        server.close()
        raise
    return server
