"""A coordinator as its clients reach it (:mod:`millpond.coordinator.client`): for a producer's
appends, a keep-alive connection, a second one for a chained request, and when to try it again
(:class:`Endpoint`); for a consumer's dequeues and make-way requests, one request on a fresh
connection each time (:func:`send_dequeue`, :func:`send_make_way`)."""

from __future__ import annotations

import http.client
import json
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from millpond.coordinator.wire import (
    DEFAULT_BUDGET,
    DEQUEUE_PATH,
    EPOCH_HEADER,
    HEALTH_PATH,
    MAKE_WAY_PATH,
    QUEUE_HEADER,
    THROUGH_HEADER,
    TOKEN_HEADER,
    TOKEN_REFUSED,
    Outcome,
)
from millpond.errors import FormatError

__all__ = [
    "FORBIDDEN",
    "LOST",
    "SENT",
    "UNSENT",
    "CoordinatorOptions",
    "Endpoint",
    "not_serving",
    "send_dequeue",
    "send_make_way",
]

SENT = "sent"
"""A request went out and a reply came."""
UNSENT = "unsent"
"""No connection could be made: nothing was sent."""
LOST = "lost"
"""Sent (or perhaps sent), no usable reply: the coordinator could not be reached or did not
answer."""
FORBIDDEN = "forbidden"
"""(a dequeue or make-way) The coordinator wants a token this request did not carry (HTTP
403): a setting to fix (:data:`~millpond.coordinator.wire.TOKEN_ENV`), not a moment to wait
out."""
_POLL = 0.01  # seconds between two calls of while_waiting while a reply is awaited


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorOptions:
    """How a producer talks to its coordinators."""

    budget: float = DEFAULT_BUDGET
    """Seconds after a request arrives during which a coordinator may write it. Default 2."""
    grace: float = 3.0
    """Seconds added to ``budget`` for the request's way to the coordinator before a writer
    that got no reply and cannot ask appends directly. Default 3. (Should a request take longer
    than that to arrive, the coordinator still never appends a location twice: a round that
    reads the manifest drops the entries it finds there.)"""
    connect_timeout: float = 1.0
    """Seconds to open a connection. Default 1."""
    retry_after: float = 5.0
    """Seconds a coordinator that could not be reached, or refused, is left alone. Default 5."""
    chain: bool = True
    """Send the batches uploaded while an append is out right away, to follow it (module
    docstring, Chaining). Default on."""
    token: str | None = field(default=None, repr=False)
    """Sent with every request (``X-Millpond-Token``) to a coordinator that wants one (a
    producer-hosted coordinator). Default none."""

    @property
    def promise(self) -> float:
        """Seconds after a request is sent during which a write of it may start: ``budget``
        plus ``grace``."""
        return self.budget + self.grace


class Endpoint:
    """One coordinator: a keep-alive connection, and when to try it again."""

    def __init__(self, url: str, options: CoordinatorOptions) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        self.url = url
        self._host = parts.hostname
        self._port = parts.port
        self._options = options
        self._auth = {TOKEN_HEADER: options.token} if options.token else {}
        self._conn: http.client.HTTPConnection | None = None
        self._spare: Endpoint | None = None
        self.down_until = float("-inf")
        self.identified = False
        """A live coordinator of the queue answered here since the endpoint was last down."""

    def spare(self) -> Endpoint:
        """A second connection to the same coordinator, for a chained request."""
        if self._spare is None:
            self._spare = Endpoint(self.url, self._options)
        return self._spare

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._spare is not None:
            self._spare.close()

    def _connect(self) -> http.client.HTTPConnection | None:
        if self._conn is not None and self._conn.sock is not None:
            return self._conn
        self.close()
        conn = http.client.HTTPConnection(
            self._host, self._port, timeout=self._options.connect_timeout
        )
        try:
            conn.connect()
        except OSError:
            conn.close()
            return None
        self._conn = conn
        # A reply later than the coordinator's promise plus the grace is lost: ask instead.
        self._set_timeout(self._options.promise)
        return conn

    def _set_timeout(self, seconds: float) -> None:
        if self._conn is not None and self._conn.sock is not None:
            self._conn.sock.settimeout(seconds)

    def connected(self) -> bool:
        """Whether a keep-alive connection is open (the next request reuses it)."""
        return self._conn is not None and self._conn.sock is not None

    def mark_down(self, until: float) -> None:
        """Leave this coordinator alone until ``until``; ask who answers before using it again."""
        self.down_until = until
        self.identified = False

    def identify(self, queue: str) -> tuple[str, str | None]:
        """Ask ``GET /v1/health`` whether a live coordinator of ``queue`` answers here:
        ``(kind, why not)`` with ``kind`` as :meth:`call` gives it, ``why not`` None when
        one does. Nothing is appended by asking."""
        # A coordinator answers this at once (no round is waited for): one that does not in
        # the time a connection may take is frozen or swamped, and the appends go directly.
        kind = self.send(HEALTH_PATH, None, {}, method="GET", timeout=self._options.connect_timeout)
        if kind == SENT:
            kind, status, data = self._response()
        if kind != SENT:
            return kind, None if kind == UNSENT else f"gave no answer to GET {HEALTH_PATH}"
        self._set_timeout(self._options.promise)
        return SENT, not_serving(status, data, queue)

    def call(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        while_waiting: Callable[[], bool] | None = None,
    ) -> tuple[str, Outcome | None]:
        """``(kind, outcome)``: ``unsent`` (no connection), ``lost`` (sent, no usable reply)
        or ``sent`` with the outcome. ``while_waiting`` is called every few milliseconds until
        the reply starts to arrive or it returns ``True``."""
        kind = self.send(path, body, headers)
        if kind != SENT:
            return kind, None
        if while_waiting is not None and not self._wait_for_reply(while_waiting):
            return LOST, None
        return self.receive()

    def send(
        self,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        *,
        method: str = "POST",
        timeout: float | None = None,
    ) -> str:
        """Send a request without waiting for the reply (:meth:`receive`): ``unsent`` or
        ``lost`` (nothing usable will come) or ``sent``. ``timeout`` replaces the reply
        timeout (the coordinator's promise plus the grace) until it is set back."""
        conn = self._connect()
        if conn is None:
            return UNSENT
        if timeout is not None:
            self._set_timeout(timeout)
        try:
            conn.request(method, path, body, {**headers, **self._auth})
        except (OSError, http.client.HTTPException):
            self.close()
            return LOST
        return SENT

    def receive(self) -> tuple[str, Outcome | None]:
        """The reply to the request :meth:`send` sent: as :meth:`call`."""
        kind, _, data = self._response()
        if kind != SENT:
            return kind, None
        try:
            return SENT, Outcome.from_json(data)
        except FormatError:
            self.close()
            return LOST, None

    def _wait_for_reply(self, while_waiting: Callable[[], bool]) -> bool:
        """Call ``while_waiting`` until the reply starts to arrive or it returns ``True``;
        ``False`` when no reply came within the reply timeout (the connection is closed)."""
        conn = self._conn
        assert conn is not None
        assert conn.sock is not None
        until = time.monotonic() + self._options.promise
        # A selector, not select(): a process with more than 1,024 descriptors (a Spark
        # executor) would have select() refuse the socket.
        with selectors.DefaultSelector() as selector:
            try:
                selector.register(conn.sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                return True  # the read that follows says what became of the connection
            while True:
                if selector.select(_POLL) or while_waiting():
                    return True
                if time.monotonic() >= until:
                    self.close()
                    return False

    def _response(self) -> tuple[str, int, bytes]:
        """Read the reply to the request just sent."""
        if self._conn is None:
            return LOST, 0, b""
        try:
            response = self._conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            return LOST, 0, b""
        if response.will_close:
            self.close()
        return SENT, response.status, data


def not_serving(status: int, data: bytes, queue: str) -> str | None:
    """Why a ``GET /v1/health`` reply is not a live coordinator of ``queue`` (None: it is)."""
    if status == 403:
        return TOKEN_REFUSED
    try:
        health = json.loads(data)
    except ValueError:
        health = None
    if status != 200 or not isinstance(health, dict) or "queue" not in health:
        return f"is not a millpond coordinator (GET {HEALTH_PATH}: HTTP {status}, {data[:60]!r})"
    if health["queue"] != queue:
        return f"serves {health['queue']!r}, not {queue!r}"
    if health.get("alive") is not True:
        return "has stopped appending (its rounds died)"
    return None


def send_dequeue(
    url: str, queue: str, epoch: int, through: int, *, timeout: float, token: str | None = None
) -> tuple[str, str]:
    """Ask the coordinator at ``url`` to dequeue through ``through`` for the consumer holding
    ``epoch`` of ``queue`` (its identity): ``(status, reason)``, the status one of ``dequeued``,
    ``fenced``, ``refused`` (:mod:`millpond.coordinator.wire`), :data:`FORBIDDEN` or
    :data:`LOST`. A fresh connection each time (a consumer dequeues about once a second at
    most); never raises. ``token``: the coordinator's
    (:data:`~millpond.coordinator.wire.TOKEN_ENV`), if it wants one."""
    headers = {EPOCH_HEADER: str(epoch), THROUGH_HEADER: str(through)}
    return _post(url, DEQUEUE_PATH, queue, headers, timeout, token)


def send_make_way(
    url: str, queue: str, *, timeout: float, token: str | None = None
) -> tuple[str, str]:
    """Ask the coordinator at ``url`` to leave the manifest of ``queue`` alone for a moment
    (a consumer's takeover comes next): ``(status, reason)``, the status ``clear`` once
    that moment has begun, else ``refused``, :data:`FORBIDDEN` or :data:`LOST`. Never
    raises."""
    return _post(url, MAKE_WAY_PATH, queue, {}, timeout, token)


def _post(
    url: str, path: str, queue: str, headers: dict[str, str], timeout: float, token: str | None
) -> tuple[str, str]:
    """One bodiless request on a fresh connection: the reply's ``(status, reason)``."""
    if token is not None:
        headers = {**headers, TOKEN_HEADER: token}
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("POST", path, b"", {QUEUE_HEADER: queue, **headers, "Content-Length": "0"})
        response = conn.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException) as err:
        return LOST, f"no answer from {url}: {err}"
    finally:
        conn.close()
    if response.status == 403:
        return FORBIDDEN, TOKEN_REFUSED
    try:
        record = json.loads(data)
        return str(record["status"]), str(record.get("reason", ""))
    except (ValueError, KeyError, TypeError):
        return LOST, f"{url} answered HTTP {response.status}, not as a coordinator: {data[:200]!r}"
