"""Shared plumbing for local services: free loopback ports, deadlines, child processes.

Every service here binds 127.0.0.1 only and runs as a child in its own process group, so that
stopping it can signal the whole group and never touches a process this module did not start.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

__all__ = [
    "LOOPBACK",
    "Closing",
    "LocalServiceError",
    "StoreEndpoint",
    "close_at_exit",
    "forget_at_exit",
    "free_ports",
    "listening_addresses",
    "log_tail",
    "stop_process_group",
    "wait_for",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
"""The only address any local service binds."""

_T = TypeVar("_T")


class LocalServiceError(RuntimeError):
    """A local service (S3 server, PostgreSQL) failed to start, answer or stop."""


class Closing:
    """``with``-block use: leaving the block calls :meth:`close`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StoreEndpoint(ABC):
    """What the S3, Azure and GCS endpoints share: their bucket or container as store URLs,
    and the store options that reach it."""

    __slots__ = ()

    @property
    @abstractmethod
    def url(self) -> str:
        """The bucket or container as a store URL."""

    def url_for(self, root: str) -> str:
        """Return the store URL of a root (object name prefix) in the bucket or container.

        Args:
            root: prefix such as ``t-1234``; leading and trailing slashes are dropped.

        Returns:
            ``{url}/{root}``, e.g. ``s3://{bucket}/{root}``.
        """
        root = root.strip("/")
        return f"{self.url}/{root}" if root else self.url

    @abstractmethod
    def store_options(self) -> dict[str, str]:
        """Return the options that reach the endpoint through ``millpond.storage.open_store``."""


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports that are free on 127.0.0.1 right now.

    All sockets are held open until every port is chosen, so the ports are distinct; they are
    closed before returning, so another process could still take one before the caller binds it.

    Args:
        count: how many ports.

    Returns:
        The port numbers.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_for(
    probe: Callable[[], _T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    alive: Callable[[], str | None] | None = None,
) -> _T:
    """Call ``probe`` until it returns something other than ``None`` or the deadline passes.

    Args:
        probe: returns ``None`` while the thing is not ready; exceptions count as not ready.
        timeout: seconds until giving up.
        what: names the awaited thing in the error message.
        interval: seconds between probes; doubles up to 0.5 s.
        alive: returns an error message once waiting is pointless (the process died).

    Returns:
        The first value ``probe`` returned that is not ``None``.

    Raises:
        LocalServiceError: the deadline passed or ``alive`` reported a failure.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = probe()
        except Exception as err:  # a server that is still starting fails in many ways
            last_error = err
            result = None
        if result is not None:
            return result
        if alive is not None and (dead := alive()) is not None:
            raise LocalServiceError(f"{what}: {dead}")
        if time.monotonic() >= deadline:
            raise LocalServiceError(
                f"{what}: not ready after {timeout:.0f} s (last error: {last_error!r})"
            )
        time.sleep(interval)
        interval = min(interval * 2, 0.5)


# Services still open at interpreter exit (a demo that crashed before close()) are closed by
# an atexit hook, so no server outlives the process that started it and no temp dir is left.
# Keyed by id(service); the value holds the PID that registered it, because a forked child
# inherits this dict and must never close its parent's servers when it exits.
_open_services: dict[int, tuple[int, Callable[[], None]]] = {}
_open_services_lock = threading.Lock()


def close_at_exit(service: object, close: Callable[[], None]) -> None:
    """Call ``close`` at interpreter exit unless :func:`forget_at_exit` is called first.

    Args:
        service: the service object (the registry holds ``close``, and so the object, until
            it is forgotten).
        close: stops the service and removes its files; must be safe to call twice.
    """
    with _open_services_lock:
        _open_services[id(service)] = (os.getpid(), close)


def forget_at_exit(service: object) -> None:
    """Undo :func:`close_at_exit` once the service is closed.

    Args:
        service: the object passed to :func:`close_at_exit`.
    """
    with _open_services_lock:
        _open_services.pop(id(service), None)


@atexit.register
def _close_services_at_exit() -> None:
    with _open_services_lock:
        leftovers = [close for pid, close in _open_services.values() if pid == os.getpid()]
    for close in leftovers:
        try:
            close()
        except Exception:  # one failed close must not keep the others running
            logger.exception("closing a local service at exit failed")


def stop_process_group(
    process: subprocess.Popen[bytes],
    *,
    timeout: float,
    name: str,
    first_signal: signal.Signals = signal.SIGTERM,
) -> None:
    """Stop a child started with ``process_group=0``: signal the group, then SIGKILL it.

    Args:
        process: the child; its PID is also its process group ID.
        timeout: seconds to wait after ``first_signal`` before SIGKILL; 0 kills at once.
        name: names the service in log lines.
        first_signal: the polite request to stop.
    """
    if process.poll() is None and timeout > 0:
        _signal_group(process.pid, first_signal)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.info(
                "%s (pid %s) still running %.1f s after %s; killing it",
                name,
                process.pid,
                timeout,
                first_signal.name,
            )
    # Kill the group even when the leader exited: a helper it forked may still be running.
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()
    logger.info("%s (pid %s) stopped with exit code %s", name, process.pid, process.returncode)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # The group is gone once every member has exited; that is the goal, not an error.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def log_tail(path: Path, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a log file, or a note that it is unreadable.

    Args:
        path: the log file.
        lines: how many lines.

    Returns:
        The text, for error messages.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(log {path} unreadable: {err})"
    return "\n".join(text.splitlines()[-lines:])


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """Return the ``(ip, port)`` of every TCP socket in LISTEN state that ``pid`` holds open.

    Reads ``/proc`` (Linux only) so that no extra dependency is needed: the socket inodes from
    ``/proc/<pid>/fd`` are matched against ``/proc/net/tcp`` and ``/proc/net/tcp6``.

    Args:
        pid: the process.

    Returns:
        Addresses as printed by ``inet_ntop``, sorted.

    Raises:
        LocalServiceError: not on Linux, or the process is gone.
    """
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes: set[str] = set()
    try:
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):  # an fd may close while we look
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError as err:
        raise LocalServiceError(f"cannot read the sockets of pid {pid}: {err}") from err
    found: list[tuple[str, int]] = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError):  # no IPv6 in this kernel
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                listen_state = "0A"
                if fields[3] == listen_state and fields[9] in inodes:
                    found.append(_decode_proc_address(fields[1], family))
    return sorted(found)


def _decode_proc_address(text: str, family: socket.AddressFamily) -> tuple[str, int]:
    # /proc/net/tcp prints the address as host-order 32-bit words in hex, then ":PORT" in hex.
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, packed), int(hex_port, 16)
