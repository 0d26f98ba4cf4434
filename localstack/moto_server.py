"""An in-process moto S3 server on a loopback port: the demo's and the fast tests' default S3.

Built from the same parts as moto's ``ThreadedMotoServer`` (werkzeug's threaded WSGI server and
moto's dispatcher app) with three changes that tests depend on:

* ``stop()`` really takes the server away: it closes the listening socket *and* every open
  keep-alive connection, so clients see connection errors (an outage), and ``start()`` can bind
  the same port again. ``ThreadedMotoServer.stop()`` leaves both open.
* Requests are served one at a time. moto checks ``If-Match`` / ``If-None-Match`` and then
  writes, without a lock: two concurrent conditional PUTs can both succeed (seen with 16
  threads racing on one key), which would break the queue manifest's compare-and-swap.
  Serialising requests makes each conditional PUT atomic, as on real S3.
* Request logs go to this module's logger at DEBUG instead of werkzeug's stderr handler.

moto keeps its data in process-global backends, so objects survive ``stop()`` / ``start()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from millpond.localstack._process import LOOPBACK, Closing, LocalServiceError, wait_for
from millpond.localstack.s3 import S3Endpoint, ensure_bucket, s3_client

__all__ = ["MotoS3Server", "start_moto"]

logger = logging.getLogger(__name__)

_StartResponse = Callable[..., Any]
_WsgiApp = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


class MotoS3Server(Closing):
    """A moto S3 server in a background thread, bound to 127.0.0.1.

    Use :func:`start_moto` rather than constructing one directly.
    """

    def __init__(
        self,
        *,
        bucket: str = "millpond",
        port: int = 0,
        access_key_id: str = "millpond",
        secret_access_key: str = "millpond-secret",
        region: str = "us-east-1",
    ) -> None:
        """Prepare a server; nothing listens until :meth:`start`.

        Args:
            bucket: bucket created on start.
            port: TCP port on 127.0.0.1; 0 picks a free one on the first start, and later
                starts reuse it.
            access_key_id: access key clients sign with (moto accepts any).
            secret_access_key: secret key clients sign with.
            region: signing region.
        """
        self._bucket = bucket
        self._port = port
        self._access_key_id = access_key_id
        self._secret_access_key = secret_access_key
        self._region = region
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (0 before the first start)."""
        return self._port

    @property
    def endpoint(self) -> S3Endpoint:
        """Where clients reach the server; stays valid across ``stop()`` / ``start()``.

        Raises:
            LocalServiceError: the server was never started, so it has no port yet.
        """
        if self._port == 0:
            raise LocalServiceError("moto S3 server: not started yet, so it has no port")
        return S3Endpoint(
            endpoint=f"http://{LOOPBACK}:{self._port}",
            bucket=self._bucket,
            access_key_id=self._access_key_id,
            secret_access_key=self._secret_access_key,
            region=self._region,
        )

    @property
    def running(self) -> bool:
        """Whether the server is accepting connections."""
        return self._server is not None

    def start(self, *, timeout: float = 10.0) -> None:
        """Bind the port, serve in a daemon thread, and create the bucket.

        Args:
            timeout: seconds to wait for the server to answer.

        Raises:
            LocalServiceError: already running, the port is taken, or it does not answer.
        """
        if self._server is not None:
            raise LocalServiceError(f"moto S3 server: already running on port {self._port}")
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        app = _SerializedApp(DomainDispatcherApplication(create_backend_app))
        try:
            server = _server_class()(LOOPBACK, self._port, app)
        except OSError as err:
            raise LocalServiceError(
                f"moto S3 server: cannot bind {LOOPBACK}:{self._port}: {err}"
            ) from err
        self._server = server
        self._port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"millpond-moto-s3-{self._port}",
            daemon=True,
        )
        self._thread.start()
        endpoint = self.endpoint
        client = s3_client(endpoint, timeout=2.0)
        wait_for(lambda: client.list_buckets(), timeout=timeout, what="moto S3 server")
        ensure_bucket(endpoint)
        logger.info("moto S3 server listening on %s, bucket %s", endpoint.endpoint, self._bucket)

    def stop(self) -> None:
        """Stop serving: close the listening socket and every open connection.

        Data stays in moto's process-global backend; :meth:`start` serves it again on the same
        port. Stopping a stopped server does nothing.
        """
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # stops serve_forever; returns once the loop has exited
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        logger.info("moto S3 server on port %s stopped", self._port)

    close = stop  # what the end of a ``with`` block calls

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"MotoS3Server(port={self._port}, bucket={self._bucket!r}, {state})"


def start_moto(bucket: str = "millpond", *, port: int = 0) -> MotoS3Server:
    """Start a moto S3 server on 127.0.0.1 with ``bucket`` created.

    Args:
        bucket: bucket to create.
        port: TCP port; 0 picks a free one.

    Returns:
        The running server; stop it with :meth:`MotoS3Server.stop` or a ``with`` block.

    Raises:
        LocalServiceError: it did not start.
    """
    server = MotoS3Server(bucket=bucket, port=port)
    server.start()
    return server


class _SerializedApp:
    """Serves one request at a time; see the module docstring for why."""

    def __init__(self, app: _WsgiApp) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        with self._lock:
            # moto returns complete bodies, so materialising them inside the lock is cheap and
            # keeps a concurrent overwrite from closing a buffer we are still reading.
            return list(self._app(environ, start_response))


@functools.cache
def _server_class() -> type[Any]:
    """Build the server classes lazily, so importing this package does not import werkzeug."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import ThreadedWSGIServer

    class QuietHandler(MotoRequestHandler):
        """Sends werkzeug's per-request log lines to our logger at DEBUG."""

        def log(self, type: str, message: str, *args: Any) -> None:
            # werkzeug passes a %-format and its arguments; format them once, at DEBUG only.
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("moto %s: %s", type, message % args if args else message)

    class TrackingServer(ThreadedWSGIServer):
        """Remembers open connections so that :meth:`close_connections` can cut them."""

        def __init__(self, host: str, port: int, app: _WsgiApp) -> None:
            self._open: set[socket.socket] = set()
            self._open_lock = threading.Lock()
            super().__init__(host, port, app, handler=QuietHandler)

        def get_request(self) -> tuple[socket.socket, Any]:
            sock, address = super().get_request()
            with self._open_lock:
                self._open.add(sock)
            return sock, address

        def shutdown_request(self, request: Any) -> None:
            with self._open_lock:
                self._open.discard(request)
            super().shutdown_request(request)

        def close_connections(self) -> None:
            with self._open_lock:
                open_sockets = list(self._open)
            for sock in open_sockets:
                # shutdown, not close: the handler thread owns the socket and closes it itself.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    return TrackingServer
