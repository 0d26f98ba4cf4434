"""A throwaway Azurite (Azure Blob Storage emulator) on a loopback port.

Azurite is the npm package ``azurite``; ``make test`` installs the version pinned in
``localstack/package.json`` into ``.venv/npm`` (``npm ci``), where :func:`find_azurite_binary`
finds ``azurite-blob``. Only the blob service runs, bound to 127.0.0.1, with telemetry off.

Requests are signed with Shared Key: Azurite's well-known development account
``devstoreaccount1`` and its published key, which is also what obstore's
``AZURE_STORAGE_USE_EMULATOR=true`` uses. The container is created here with a signed REST call
(obstore has no "create container").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

from millpond.localstack._child import ChildServer, start_or_close
from millpond.localstack._process import LOOPBACK, LocalServiceError, StoreEndpoint, wait_for

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AzureEndpoint",
    "Azurite",
    "find_azurite_binary",
    "start_azurite",
]

logger = logging.getLogger(__name__)

AZURITE_ACCOUNT = "devstoreaccount1"
"""Azurite's well-known development account."""
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
"""Its published Shared Key (public: Azurite accepts it on every machine)."""
_API_VERSION = "2021-08-06"
_BINARY_ENV = "MILLPOND_AZURITE_BLOB"


@dataclass(frozen=True, slots=True, kw_only=True)
class AzureEndpoint(StoreEndpoint):
    """An Azure Blob endpoint, a container on it and the Shared Key to sign with."""

    endpoint: str
    """Blob service URL including the account, e.g. ``http://127.0.0.1:41234/devstoreaccount1``."""
    container: str
    """Container name; it exists once a server hands the endpoint out."""
    account_name: str = AZURITE_ACCOUNT
    account_key: str = field(default=AZURITE_KEY, repr=False)
    """Shared Key; left out of ``repr``."""

    @property
    def url(self) -> str:
        """The container as a store URL, ``az://{container}``."""
        return f"az://{self.container}"

    def store_options(self) -> dict[str, str]:
        """Return obstore Azure options for this endpoint.

        Returns:
            ``azure_storage_account_name``, ``azure_storage_account_key`` and
            ``azure_storage_endpoint`` (plain HTTP on loopback is allowed for it).
        """
        return {
            "azure_storage_account_name": self.account_name,
            "azure_storage_account_key": self.account_key,
            "azure_storage_endpoint": self.endpoint,
        }

    def env(self) -> dict[str, str]:
        """Return the standard environment variables for this endpoint (for child processes):
        :meth:`store_options` in upper case.

        Returns:
            ``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY`` and
            ``AZURE_STORAGE_ENDPOINT``.
        """
        return {key.upper(): value for key, value in self.store_options().items()}

    def emulator_env(self) -> dict[str, str]:
        """Return the emulator switch obstore knows: the well-known account at this URL.

        Returns:
            ``AZURE_STORAGE_USE_EMULATOR=true`` and ``AZURITE_BLOB_STORAGE_URL``.
        """
        return {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint.rsplit("/", 1)[0],
        }


def find_azurite_binary() -> Path:
    """Locate ``azurite-blob``: ``$MILLPOND_AZURITE_BLOB``, then ``.venv/npm``, then ``PATH``.

    Returns:
        The path of an executable ``azurite-blob``.

    Raises:
        LocalServiceError: none found; ``make test`` installs it (``npm ci`` into .venv/npm).
    """
    candidates = []
    if os.environ.get(_BINARY_ENV):
        candidates.append(Path(os.environ[_BINARY_ENV]))
    candidates.append(Path(sys.prefix) / "npm" / "node_modules" / ".bin" / "azurite-blob")
    on_path = shutil.which("azurite-blob")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise LocalServiceError(
        "Azurite: no azurite-blob in .venv/npm or on PATH; run `make test` (it installs "
        "localstack/package.json with npm ci) or set MILLPOND_AZURITE_BLOB"
    )


class Azurite(ChildServer):
    """Azurite's blob service on 127.0.0.1, run as a child process group.

    Its blob index lives in memory and is saved on a polite stop (``stop()``'s SIGTERM); a
    SIGKILL (``stop(timeout=0)``) loses what was not saved yet, like a crash.

    Use :func:`start_azurite` rather than constructing one directly.
    """

    name = "Azurite"

    def __init__(
        self,
        *,
        container: str = "millpond",
        data_dir: Path | None = None,
        binary: Path | None = None,
    ) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            container: container created on start.
            data_dir: directory for data and the log; a temp dir (removed by ``close()``)
                when ``None``.
            binary: ``azurite-blob``; found with :func:`find_azurite_binary` when ``None``.
        """
        # Find the binary first: a missing one must not leave a temp dir behind.
        found = binary if binary is not None else find_azurite_binary()
        super().__init__(binary=found, data_dir=data_dir, temp_prefix="millpond-azurite-")
        self._container = container

    @property
    def endpoint(self) -> AzureEndpoint:
        """Where clients reach the blob service; stays valid across ``stop()`` / ``start()``.

        Raises:
            LocalServiceError: never started, so there is no port yet.
        """
        if self.port == 0:
            raise LocalServiceError("Azurite: not started yet, so it has no port")
        return AzureEndpoint(
            endpoint=f"http://{LOOPBACK}:{self.port}/{AZURITE_ACCOUNT}", container=self._container
        )

    def command(self) -> list[str]:
        return [
            str(self._binary),
            "--blobHost",
            LOOPBACK,
            "--blobPort",
            str(self.port),
            "--location",
            str(self.root / "data"),
            "--disableTelemetry",  # no reports leave the machine
            "--skipApiVersionCheck",  # obstore's x-ms-version may be newer than this Azurite
            "--silent",  # no access log
        ]

    def _wait_ready(self, timeout: float) -> None:
        endpoint = self.endpoint
        wait_for(
            lambda: create_container(endpoint),
            timeout=timeout,
            what="Azurite container",
            alive=self._exit_reason,
        )
        self._wait_writable(
            endpoint, timeout=timeout, what=f"Azurite container {endpoint.container}"
        )


def create_container(endpoint: AzureEndpoint) -> bool:
    """Create the endpoint's container unless it exists (a Shared Key signed REST call).

    Returns:
        ``True`` (for :func:`wait_for`).

    Raises:
        urllib.error.HTTPError: the service refused for another reason than "exists".
    """
    url = f"{endpoint.endpoint}/{endpoint.container}?restype=container"
    headers = {
        "x-ms-date": formatdate(usegmt=True),
        "x-ms-version": _API_VERSION,
        "Content-Length": "0",
        "Content-Type": "application/octet-stream",
    }
    path = f"/{endpoint.account_name}/{endpoint.container}"
    if endpoint.endpoint.rstrip("/").endswith(f"/{endpoint.account_name}"):
        path = f"/{endpoint.account_name}{path}"  # path-style URL: the account is in the path
    string_to_sign = "\n".join(
        [
            "PUT",
            *[""] * 4,  # Content-Encoding, -Language, -Length (0 is empty), -MD5
            headers["Content-Type"],
            *[""] * 6,  # Date (x-ms-date instead), the If-* headers, Range
            f"x-ms-date:{headers['x-ms-date']}",
            f"x-ms-version:{_API_VERSION}",
            f"{path}\nrestype:container",
        ]
    )
    key = base64.b64decode(endpoint.account_key)
    signature = base64.b64encode(
        hmac.new(key, string_to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    headers["Authorization"] = f"SharedKey {endpoint.account_name}:{signature}"
    request = urllib.request.Request(url, method="PUT", headers=headers, data=b"")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()
        logger.info("created container %s at %s", endpoint.container, endpoint.endpoint)
    except urllib.error.HTTPError as err:
        if err.code != 409:  # ContainerAlreadyExists
            raise
    return True


def start_azurite(
    container: str = "millpond", data_dir: Path | None = None, *, timeout: float = 60.0
) -> Azurite:
    """Start Azurite's blob service on 127.0.0.1 with ``container`` created.

    Args:
        container: container to create.
        data_dir: where data and the log go; a temp dir (deleted by ``close()``) if ``None``.
        timeout: seconds to wait for it to become writable.

    Returns:
        The running server; end it with :meth:`Azurite.close` or a ``with`` block.

    Raises:
        LocalServiceError: it did not start (the log tail included), or no ``azurite-blob``.
    """
    return start_or_close(Azurite(container=container, data_dir=data_dir), timeout=timeout)
