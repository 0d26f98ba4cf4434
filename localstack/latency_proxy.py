"""A loopback HTTP proxy in front of an object store: latency per request, and an off switch.

Loopback object stores answer a request in 2-3 ms; real S3 Standard takes 50-70 ms, and that
is what decides how compare-and-swap writers contend on one manifest. :class:`LatencyProxy`
sits between a client and any plain-HTTP object store (SeaweedFS, moto, MinIO, Azurite,
fake-gcs-server) and holds every request back by a configurable delay, optionally with seeded
jitter, before forwarding it. It counts requests, and :meth:`LatencyProxy.cut` makes the store
unreachable (every open connection is reset and new ones are refused) until
:meth:`LatencyProxy.restore`.

How it forwards. Each client connection gets its own upstream connection; bytes flow through
unchanged in both directions, headers included. That keeps S3 SigV4 intact: the signature
covers the ``Host`` header the client used (the proxy's address), and the server checks it
against the ``Host`` header it receives, which is the same one. Only the client-to-server
direction is parsed, and only as far as HTTP/1.1 framing needs (request line, headers,
``Content-Length`` or ``Transfer-Encoding: chunked``), to find where each request starts: the
delay is applied once per request, when its head has arrived and before any of it is
forwarded. A request's latency therefore grows by the delay whatever its size; bodies stream
after it. Keep-alive, pipelining and ``Expect: 100-continue`` work as they do without the proxy.

The proxy serves all connections concurrently on one asyncio loop in a daemon thread, so a
client's connection pool sees the delay on every connection at once, not one after another.
It binds 127.0.0.1 only. It speaks plain HTTP; an ``https://`` upstream is refused.

Run it by hand to rehearse a deployment on a laptop::

    python -m millpond.localstack.latency_proxy --seaweedfs --delay-ms 50
    python -m millpond.localstack.latency_proxy --upstream http://127.0.0.1:9000 --delay-ms 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import random
import signal
import socket
import struct
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from millpond.localstack._process import (
    LOOPBACK,
    Closing,
    LocalServiceError,
    close_at_exit,
    forget_at_exit,
)
from millpond.localstack.s3 import S3Endpoint

__all__ = ["DelayModel", "LatencyProxy", "ProxyStats", "start_latency_proxy"]

logger = logging.getLogger(__name__)

_HEAD_LIMIT = 1 << 20  # bytes of one request head (line + headers) before it is refused
_CHUNK = 256 * 1024
# SO_LINGER on, timeout 0: close() sends a RST instead of a FIN, as a dead server's host does.
_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """What went through the proxy since it started (or since :meth:`LatencyProxy.reset_stats`)."""

    requests: int
    """Requests forwarded (or dropped by :meth:`LatencyProxy.cut` while being held back)."""
    by_method: dict[str, int]
    """``requests`` split by HTTP method."""
    connections: int
    """Client connections accepted while the store was reachable."""
    refused: int
    """Client connections reset on arrival because the store was cut off."""
    reset: int
    """Open client connections reset by :meth:`LatencyProxy.cut`."""
    peak_held: int
    """The most requests held back at the same moment (above 1: served concurrently)."""
    delay_seconds: float
    """Sum of the delays applied."""


class DelayModel:
    """The delay of each request: ``delay`` plus uniform jitter in ``[0, jitter]``, seeded.

    The same seed gives the same sequence of delays, in the order requests arrive.
    """

    def __init__(self, delay: float, jitter: float = 0.0, seed: int | None = None) -> None:
        """Set the delay.

        Args:
            delay: seconds added to every request; ``>= 0``.
            jitter: seconds; each request adds a uniform draw from ``[0, jitter]``.
            seed: seeds the jitter; ``None`` draws a fresh seed.

        Raises:
            ValueError: a negative delay or jitter.
        """
        if delay < 0:
            raise ValueError(f"delay: expected >= 0 seconds, found {delay}")
        if jitter < 0:
            raise ValueError(f"jitter: expected >= 0 seconds, found {jitter}")
        self.delay = delay
        self.jitter = jitter
        self._random = random.Random(seed)

    def next(self) -> float:
        """Return the delay of the next request, in seconds."""
        if self.jitter == 0:
            return self.delay
        return self.delay + self._random.uniform(0.0, self.jitter)


@dataclass(eq=False)
class _Pair:
    """One client connection and its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class LatencyProxy(Closing):
    """A latency-injecting HTTP proxy on 127.0.0.1 in front of one object store.

    Use :func:`start_latency_proxy` rather than constructing one directly. Thread-safe: every
    method may be called from any thread.
    """

    def __init__(
        self,
        upstream: S3Endpoint | str,
        *,
        delay: float = 0.05,
        jitter: float = 0.0,
        seed: int | None = None,
    ) -> None:
        """Prepare a proxy; nothing listens until :meth:`start`.

        Args:
            upstream: the store, as an :class:`S3Endpoint` or a base URL
                ``http://host:port``.
            delay: seconds each request is held back before it is forwarded. Default 0.05.
            jitter: seconds; each request is held back a further uniform ``[0, jitter]``.
            seed: seeds the jitter, so a run can be repeated.

        Raises:
            ValueError: an ``https://`` or malformed upstream, or a negative delay or jitter.
        """
        self._s3 = upstream if isinstance(upstream, S3Endpoint) else None
        url = upstream.endpoint if isinstance(upstream, S3Endpoint) else upstream
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream: expected an http://host:port URL, found {url!r}")
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port or 80
        self._model = DelayModel(delay, jitter, seed)
        self._lock = threading.Lock()
        self._reachable = True
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._held = 0
        self._zero_stats()

    # -- where -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The proxy's port on 127.0.0.1 (0 before :meth:`start`)."""
        return self._port

    @property
    def url(self) -> str:
        """The proxy's base URL, ``http://127.0.0.1:<port>``: point clients here.

        Raises:
            LocalServiceError: not started yet.
        """
        if not self._port:
            raise LocalServiceError("latency proxy: not started yet, so it has no port")
        return f"http://{LOOPBACK}:{self._port}"

    @property
    def upstream_url(self) -> str:
        """The store the proxy forwards to."""
        return f"http://{self._upstream_host}:{self._upstream_port}"

    @property
    def endpoint(self) -> S3Endpoint:
        """The upstream S3 endpoint with the proxy's URL: same bucket, keys and region.

        Its ``url_for(root)`` and ``store_options()`` send every request through the proxy.

        Raises:
            LocalServiceError: not started yet, or the upstream was given as a plain URL.
        """
        if self._s3 is None:
            raise LocalServiceError(
                "latency proxy: the upstream was given as a URL, not an S3Endpoint; use .url"
            )
        return dataclasses.replace(self._s3, endpoint=self.url)

    # -- the knobs ---------------------------------------------------------------------------

    @property
    def delay(self) -> float:
        """Seconds each request is held back (before jitter)."""
        return self._model.delay

    @property
    def jitter(self) -> float:
        """Seconds of uniform jitter added on top of :attr:`delay`."""
        return self._model.jitter

    def set_delay(self, delay: float, jitter: float = 0.0, seed: int | None = None) -> None:
        """Change the delay for requests that arrive from now on.

        Raises:
            ValueError: a negative delay or jitter.
        """
        model = DelayModel(delay, jitter, seed)
        with self._lock:
            self._model = model

    @property
    def reachable(self) -> bool:
        """Whether the store is reachable through the proxy (see :meth:`cut`)."""
        return self._reachable

    def cut(self) -> None:
        """Make the store unreachable: reset every open connection and refuse new ones.

        Requests being held back are dropped with their connections. Returns once every
        connection is reset. Idempotent.

        Raises:
            LocalServiceError: not started.
        """
        self._reachable = False
        loop = self._loop
        if loop is None or not loop.is_running():
            raise LocalServiceError("latency proxy: not running")
        asyncio.run_coroutine_threadsafe(self._reset_all(), loop).result(timeout=10)

    def restore(self) -> None:
        """Make the store reachable again (undo :meth:`cut`). Idempotent."""
        self._reachable = True

    @contextlib.contextmanager
    def unreachable(self) -> Iterator[None]:
        """``with proxy.unreachable(): ...`` cuts the store off for the block.

        Raises:
            LocalServiceError: not started.
        """
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def stats(self) -> ProxyStats:
        """Return the counts so far."""
        with self._lock:
            return ProxyStats(
                requests=self._requests,
                by_method=dict(self._by_method),
                connections=self._connections,
                refused=self._refused,
                reset=self._reset,
                peak_held=self._peak_held,
                delay_seconds=round(self._delay_seconds, 6),
            )

    def reset_stats(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._zero_stats()

    # -- life cycle --------------------------------------------------------------------------

    def start(self, *, timeout: float = 10.0) -> None:
        """Bind 127.0.0.1 on a free port and start serving on a daemon thread.

        Raises:
            LocalServiceError: already started, or it did not come up within ``timeout``.
        """
        if self._thread is not None:
            raise LocalServiceError("latency proxy: already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, LOOPBACK, 0, limit=_HEAD_LIMIT)
                )
                self._port = int(self._server.sockets[0].getsockname()[1])
            except BaseException as err:
                failure.append(err)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=serve, name="millpond-latency-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            self.close()
            cause = failure[0] if failure else None
            raise LocalServiceError(f"latency proxy did not start: {cause!r}") from cause
        close_at_exit(self, self.close)
        logger.info(
            "latency proxy on %s -> %s, delay %.1f ms (+ up to %.1f ms jitter)",
            self.url,
            self.upstream_url,
            self._model.delay * 1000,
            self._model.jitter * 1000,
        )

    def close(self) -> None:
        """Reset every connection, stop listening and join the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already stopped
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        self._thread = None
        self._loop = None
        forget_at_exit(self)

    def __repr__(self) -> str:
        where = f"{LOOPBACK}:{self._port}" if self._port else "not started"
        return (
            f"LatencyProxy({where} -> {self.upstream_url}, delay={self._model.delay}, "
            f"jitter={self._model.jitter}, reachable={self._reachable})"
        )

    # -- internals (all on the loop thread) --------------------------------------------------

    def _zero_stats(self) -> None:
        self._requests = 0
        self._by_method: Counter[str] = Counter()
        self._connections = 0
        self._refused = 0
        self._reset = 0
        self._peak_held = 0
        self._delay_seconds = 0.0

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A handler cancelled at shutdown ends quietly: asyncio's stream protocol logs the
        # exception of a handler task that ends cancelled as an error.
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._reachable:
            with self._lock:
                self._refused += 1
            _reset(writer)
            return
        with self._lock:
            self._connections += 1
        pair = _Pair(writer)
        self._pairs.add(pair)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    self._upstream_host, self._upstream_port, limit=_HEAD_LIMIT
                )
            except OSError as err:
                logger.warning("latency proxy: cannot reach %s: %s", self.upstream_url, err)
                _reset(writer)
                return
            pair.upstream = up_writer
            if not self._reachable:  # cut while connecting
                _reset(writer)
                _reset(up_writer)
                return
            down = asyncio.create_task(_pump(up_reader, writer))
            up = asyncio.create_task(self._forward_requests(reader, up_writer))
            pair.tasks.update((down, up))
            # Either side ending ends the pair: the upstream closing after a response
            # ("Connection: close") or the client going away.
            await asyncio.wait((down, up), return_when=asyncio.FIRST_COMPLETED)
            for task in (down, up):
                task.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            _close(up_writer)
            _close(writer)
        finally:
            self._pairs.discard(pair)

    async def _forward_requests(
        self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter
    ) -> None:
        """Forward requests one after another, holding each back by the delay first."""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed the connection between requests
            except asyncio.LimitOverrunError:
                logger.warning("latency proxy: a request head over %s bytes; closing", _HEAD_LIMIT)
                return
            method, length, chunked = _parse_head(head)
            await self._hold(method)
            if not self._reachable:
                return
            upstream.write(head)
            if chunked:
                await _copy_chunked(reader, upstream)
            elif length:
                await _copy_exactly(reader, upstream, length)
            await upstream.drain()

    async def _hold(self, method: str) -> None:
        with self._lock:
            delay = self._model.next()
            self._requests += 1
            self._by_method[method] += 1
            self._delay_seconds += delay
            self._held += 1
            self._peak_held = max(self._peak_held, self._held)
        try:
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            with self._lock:
                self._held -= 1

    async def _reset_all(self) -> None:
        pairs = list(self._pairs)
        for pair in pairs:
            _reset(pair.client)
            if pair.upstream is not None:
                _reset(pair.upstream)
            for task in pair.tasks:
                task.cancel()
        with self._lock:
            self._reset += len(pairs)
        # Let the cancelled tasks unwind before cut() returns.
        await asyncio.sleep(0)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()
        # Connection handlers still unwinding must finish before the loop closes.
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5)


def _parse_head(head: bytes) -> tuple[str, int, bool]:
    """Method, ``Content-Length`` and whether the body is chunked, from a request head."""
    lines = head.split(b"\r\n")
    method = lines[0].split(b" ", 1)[0].decode("ascii", "replace") or "?"
    length = 0
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-length":
            with contextlib.suppress(ValueError):
                length = int(value.strip())
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return method, length, chunked


async def _copy_exactly(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int
) -> None:
    left = length
    while left > 0:
        data = await reader.read(min(left, _CHUNK))
        if not data:
            raise ConnectionError("client closed the connection inside a request body")
        writer.write(data)
        left -= len(data)
        await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        writer.write(size_line)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        await _copy_exactly(reader, writer, size + 2)  # the data and its CRLF
    while True:  # trailer fields, up to the empty line
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        if line == b"\r\n":
            return


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy the server's bytes to the client until the server closes."""
    while data := await reader.read(_CHUNK):
        writer.write(data)
        await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


def start_latency_proxy(
    upstream: S3Endpoint | str,
    *,
    delay: float = 0.05,
    jitter: float = 0.0,
    seed: int | None = None,
) -> LatencyProxy:
    """Start a latency proxy on 127.0.0.1 in front of ``upstream``.

    Args:
        upstream: the store, as an :class:`S3Endpoint` or a base URL ``http://host:port``.
        delay: seconds each request is held back. Default 0.05 (S3 Standard's order).
        jitter: seconds of uniform jitter on top, per request. Default 0.
        seed: seeds the jitter.

    Returns:
        The running proxy; end it with :meth:`LatencyProxy.close` or a ``with`` block.

    Raises:
        ValueError: an unusable upstream URL or a negative delay.
        LocalServiceError: it did not start.
    """
    proxy = LatencyProxy(upstream, delay=delay, jitter=jitter, seed=seed)
    proxy.start()
    return proxy


def main(argv: Sequence[str] | None = None) -> int:
    """Run a proxy until Ctrl-C; print where clients should point.

    Returns:
        The exit code.
    """
    parser = argparse.ArgumentParser(
        prog="python -m millpond.localstack.latency_proxy",
        description="A loopback HTTP proxy that adds latency to every object-store request.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--upstream", help="the store's base URL, e.g. http://127.0.0.1:9000")
    target.add_argument(
        "--seaweedfs", action="store_true", help="start a throwaway SeaweedFS behind the proxy"
    )
    parser.add_argument("--delay-ms", type=float, default=50.0, help="per request (default 50)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform, on top (default 0)")
    parser.add_argument("--seed", type=int, default=None, help="seeds the jitter")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # Installed before the address is printed: whoever read it may send SIGTERM at once.
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with contextlib.ExitStack() as stack:
        upstream: S3Endpoint | str = args.upstream
        if args.seaweedfs:
            from millpond.localstack.seaweedfs import start_seaweedfs

            upstream = stack.enter_context(start_seaweedfs()).endpoint
        proxy = stack.enter_context(
            start_latency_proxy(
                upstream,
                delay=args.delay_ms / 1000,
                jitter=args.jitter_ms / 1000,
                seed=args.seed,
            )
        )
        print(f"proxy {proxy.url} -> {proxy.upstream_url}, {args.delay_ms:g} ms per request")
        if isinstance(upstream, S3Endpoint):
            for key, value in proxy.endpoint.env().items():
                print(f"export {key}={value}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            stopped.wait()
        print(f"requests: {proxy.stats().requests}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
