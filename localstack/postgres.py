"""A throwaway PostgreSQL cluster from the machine's server binaries, on a loopback port.

The cluster lives in a temp dir (data, unix socket, log), listens on 127.0.0.1 only, trusts
loopback connections, and has a ``millpond`` database. PostgreSQL refuses to run as root, so
when this process is root the server runs as the ``postgres`` OS user. ``fsync`` stays on unless
asked otherwise: durability tests must see the real thing.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from millpond.localstack._child import ChildProcess
from millpond.localstack._process import (
    LOOPBACK,
    LocalServiceError,
    forget_at_exit,
    log_tail,
    wait_for,
)

__all__ = ["PostgresServer", "find_postgres_bin_dir", "start_postgres"]

logger = logging.getLogger(__name__)

_SERVER_BINARIES = ("initdb", "postgres", "createdb")
# Where distributions put versioned server binaries (Debian/Ubuntu, then RHEL/PGDG).
_VERSIONED_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
_SUPERUSER = "postgres"
# Line 8 of postmaster.pid is the postmaster's status; "ready" means it accepts connections.
_PIDFILE_STATUS_LINE = 7
_FAST_SHUTDOWN_SECONDS = 10.0


def find_postgres_bin_dir() -> Path:
    """Find a directory holding ``initdb``, ``postgres`` and ``createdb``.

    Prefers the highest version under ``/usr/lib/postgresql/*/bin`` (or ``/usr/pgsql-*/bin``),
    then the directory of ``initdb`` on ``PATH``.

    Returns:
        The directory.

    Raises:
        LocalServiceError: no PostgreSQL server binaries on this machine.
    """
    versioned: list[tuple[tuple[int, ...], Path]] = []
    for pattern in _VERSIONED_BIN_GLOBS:
        for directory in Path("/").glob(pattern.lstrip("/")):
            version = tuple(int(n) for n in re.findall(r"\d+", directory.parent.name))
            versioned.append((version, directory))
    candidates = [d for _, d in sorted(versioned, reverse=True)]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for directory in candidates:
        if all(os.access(directory / name, os.X_OK) for name in _SERVER_BINARIES):
            return directory
    raise LocalServiceError(
        "PostgreSQL: no server binaries (initdb, postgres) under /usr/lib/postgresql/*/bin or "
        "on PATH; install the `postgresql` package (`make postgres-binaries`)"
    )


class PostgresServer(ChildProcess):
    """A PostgreSQL postmaster on 127.0.0.1 in its own temp dir, run as a child process group.

    Each :meth:`start` creates a fresh cluster in a fresh temp dir (data, unix socket,
    ``postgres.log``) on fresh ports; :meth:`stop` shuts it down and deletes the directory
    (``keep=True`` leaves it, to look at afterwards).

    Use :func:`start_postgres` rather than constructing one directly.
    """

    name = "PostgreSQL"
    log_name = "postgres.log"
    # What `pg_ctl stop -m fast` sends (pg_ctl itself refuses to run as root).
    stop_signal = signal.SIGINT

    def __init__(
        self,
        *,
        database: str = "millpond",
        bin_dir: Path | None = None,
        fsync: bool = True,
        keep: bool = False,
    ) -> None:
        """Prepare a cluster; nothing runs until :meth:`start`.

        Args:
            database: database created on start.
            bin_dir: directory of the server binaries; found with
                :func:`find_postgres_bin_dir` when ``None``.
            fsync: the server's ``fsync`` setting; keep it on unless a benchmark says otherwise.
            keep: leave the cluster's directory when the server stops.
        """
        found = bin_dir if bin_dir is not None else find_postgres_bin_dir()
        super().__init__(binary=found / "postgres")
        self._bin_dir = found
        self._database = database
        self._fsync = fsync
        self._keep = keep
        self._root: Path | None = None
        self._env: dict[str, str] = {}
        self._run_as: dict[str, Any] = {}

    @property
    def url(self) -> str:
        """Connection URL, ``postgresql://postgres@127.0.0.1:PORT/millpond`` (trust auth)."""
        return f"postgresql://{_SUPERUSER}@{LOOPBACK}:{self.port}/{self._database}"

    @property
    def root(self) -> Path | None:
        """The temp dir holding ``data/``, the unix socket and ``postgres.log``, while running."""
        return self._root

    @property
    def _workdir(self) -> Path:
        if self._root is None:
            raise LocalServiceError("PostgreSQL: not started, so it has no directory")
        return self._root

    def command(self) -> list[str]:
        root = self._workdir
        return [
            str(self._binary),
            "-D", str(root / "data"),
            "-p", str(self.port),
            "-c", f"listen_addresses={LOOPBACK}",
            "-c", f"unix_socket_directories={root}",
            "-c", f"fsync={'on' if self._fsync else 'off'}",
            "-c", "logging_collector=off",
        ]  # fmt: skip

    def start(self, *, timeout: float = 60.0) -> None:
        """Create the cluster, start the postmaster, wait until it accepts, create the database.

        Args:
            timeout: seconds to wait for the server to accept connections.

        Raises:
            LocalServiceError: already started, or a step failed (the log tail is included).
        """
        if self._process is not None:
            raise LocalServiceError(f"PostgreSQL: already running (pid {self.pid})")
        try:
            super().start(timeout=timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, *, timeout: float = _FAST_SHUTDOWN_SECONDS) -> None:
        """Fast shutdown, then delete the cluster's temp dir (unless the server keeps it).

        Sends SIGINT to the postmaster, which is exactly what ``pg_ctl stop -m fast`` does
        (``pg_ctl`` itself refuses to run as root), and SIGKILLs the process group if it is
        still there after ``timeout``. Stopping a stopped server does nothing.

        Args:
            timeout: seconds to wait for the fast shutdown.
        """
        self._terminate(timeout=timeout)
        root, self._root = self._root, None
        if root is not None and not self._keep:
            shutil.rmtree(root, ignore_errors=True)
        forget_at_exit(self)

    def close(self, *, timeout: float | None = None) -> None:
        """The same as :meth:`stop` (with its default ``timeout`` when ``None``).

        Args:
            timeout: seconds to wait for the fast shutdown.
        """
        self.stop(timeout=_FAST_SHUTDOWN_SECONDS if timeout is None else timeout)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"PostgresServer(url={self.url!r}, {state})"

    def _prepare(self) -> None:
        # A fresh cluster in a fresh temp dir on fresh ports, every start.
        self._ports = {}
        root = Path(tempfile.mkdtemp(prefix="millpond-pg-"))
        self._root = root
        self._run_as = _server_user_kwargs()
        if self._run_as:
            # The server user must own its directories; root's mkdtemp made them root-only.
            os.chown(root, self._run_as["user"], self._run_as["group"])
        self._env = _clean_env()
        self._run(
            [
                str(self._bin_dir / "initdb"),
                f"--pgdata={root / 'data'}",
                f"--username={_SUPERUSER}",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                # Only initdb's final flush of a cluster that dies with this process; the
                # server below keeps fsync on.
                "--no-sync",
            ],
            run_as=self._run_as,
        )

    def _popen_options(self) -> dict[str, Any]:
        return {"env": self._env, **self._run_as}

    def _wait_ready(self, timeout: float) -> None:
        data = self._workdir / "data"
        wait_for(
            lambda: True if _pidfile_status(data) == "ready" else None,
            timeout=timeout,
            what=f"PostgreSQL on port {self.port}",
            alive=self._exit_reason,
        )
        self._run(
            [
                str(self._bin_dir / "createdb"),
                f"--host={LOOPBACK}",
                f"--port={self.port}",
                f"--username={_SUPERUSER}",
                self._database,
            ],
            run_as={},
        )

    def _run(self, argv: list[str], *, run_as: dict[str, Any]) -> None:
        """Run one of the server's tools in the cluster's directory; its output goes to
        ``<tool>.log`` there.

        Raises:
            LocalServiceError: it failed (the log tail included).
        """
        log_path = self._workdir / f"{Path(argv[0]).name}.log"
        with log_path.open("ab") as log:
            result = subprocess.run(
                argv,
                cwd=self._workdir,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
                **run_as,
            )
        if result.returncode != 0:
            raise LocalServiceError(
                f"PostgreSQL: {Path(argv[0]).name} exited with code {result.returncode}\n"
                f"{log_tail(log_path)}"
            )


def start_postgres(
    database: str = "millpond",
    *,
    fsync: bool = True,
    timeout: float = 60.0,
    keep: bool = False,
) -> PostgresServer:
    """Start a throwaway PostgreSQL on 127.0.0.1 with ``database`` created.

    Args:
        database: database to create.
        fsync: the server's ``fsync`` setting (on by default).
        timeout: seconds to wait for it to accept connections.
        keep: leave the cluster's directory (``root``) when the server stops.

    Returns:
        The running server; end it with :meth:`PostgresServer.stop` or a ``with`` block.

    Raises:
        LocalServiceError: no binaries, or it did not start.
    """
    server = PostgresServer(database=database, fsync=fsync, keep=keep)
    server.start(timeout=timeout)
    return server


def _server_user_kwargs() -> dict[str, Any]:
    """Popen arguments that drop root to the ``postgres`` user; empty when not root."""
    if os.geteuid() != 0:
        return {}
    try:
        account = pwd.getpwnam(_SUPERUSER)
    except KeyError as err:
        raise LocalServiceError(
            "PostgreSQL: running as root needs a `postgres` OS user to run the server as"
        ) from err
    # user/group/extra_groups switch in the child before exec: no runuser/su in between, so
    # the PID we hold is the postmaster's own.
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def _clean_env() -> dict[str, str]:
    # PGDATA, PGPORT, PGHOST and friends from the caller's shell would redirect the tools.
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _pidfile_status(data: Path) -> str | None:
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return None
    if len(lines) <= _PIDFILE_STATUS_LINE:
        return None
    return lines[_PIDFILE_STATUS_LINE].strip()
