"""An in-process network for the checker's coordinators: HTTP without real sockets.

A real socket is not schedulable: a thread blocked in ``recv`` holds the baton of
:mod:`tests.system.runtime` while the thread that would answer it cannot run. During a schedule
the coordinator's HTTP therefore runs over :class:`SimSocket` pairs, byte streams whose reads
and writes are scheduling points and whose timeouts are simulated time. Everything above the
socket is the real code: ``http.client`` in the producers' and consumers' clients
(``HTTPConnection`` with :meth:`SimNet.connection_class`'s ``connect``), ``http.server`` and
``socketserver`` in the coordinator (its server class made by :meth:`SimNet.server_class`,
which listens here instead of on a port, and serves each connection on a registered thread).

Addresses are ``127.0.0.1`` and ports the network hands out (from 20000, in order, so a seed
gives the same ones); a port whose server closed refuses connections until a server listens on
it again. Nothing here binds a real socket.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import socket
import socketserver
from collections import deque
from typing import Any

from tests.system import runtime as rt
from tests.system.primitives import SimCondition, SimEvent, SimLock

__all__ = ["SimNet", "SimSelector", "SimSocket"]

_FIRST_PORT = 20000


class _Pipe:
    """One direction of a connection: bytes written by one end, read by the other."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False  # the writer shut down or closed: end of file once drained
        self.changed = SimCondition(SimLock())


class SimSocket:
    """One end of a simulated TCP connection (the interface ``http.client`` and
    ``socketserver`` use)."""

    def __init__(self, net: SimNet, inbound: _Pipe, outbound: _Pipe, peer: tuple[str, int]):
        self._net = net
        self._in = inbound
        self._out = outbound
        self._peer = peer
        self._timeout: float | None = None
        self._closed = False
        self.family = socket.AF_INET
        self.type = socket.SOCK_STREAM

    # -- options ----------------------------------------------------------------------------

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool) -> None:
        self._timeout = None if flag else 0.0

    def setsockopt(self, *args: Any) -> None:
        pass

    def getpeername(self) -> tuple[str, int]:
        return self._peer

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 0)

    def fileno(self) -> int:
        return -1

    # -- data -------------------------------------------------------------------------------

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        pipe = self._out
        with pipe.changed:
            if pipe.closed:
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
            pipe.data += bytes(data)
            pipe.changed.notify_all()

    def send(self, data: bytes | bytearray | memoryview) -> int:
        self.sendall(data)
        return len(data)

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        if self._closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        view = memoryview(buffer).cast("B")
        wanted = nbytes or len(view)
        pipe = self._in
        with pipe.changed:
            if not pipe.changed.wait_for(lambda: pipe.data or pipe.closed, self._timeout):
                raise TimeoutError("timed out")
            count = min(wanted, len(pipe.data))
            view[:count] = pipe.data[:count]
            del pipe.data[:count]
            return count

    def recv(self, size: int) -> bytes:
        buffer = bytearray(size)
        count = self.recv_into(buffer)
        return bytes(buffer[:count])

    def readable_now(self) -> bool:
        """Whether a read would not block (data, or the end of the stream)."""
        return bool(self._in.data) or self._in.closed

    def makefile(self, mode: str = "r", buffering: int | None = None, **_: Any) -> Any:
        raw = _SocketRaw(self, mode)
        size = buffering if buffering is not None and buffering > 0 else io.DEFAULT_BUFFER_SIZE
        if "w" in mode:
            return io.BufferedWriter(raw, size)
        return io.BufferedReader(raw, size)

    def shutdown(self, how: int) -> None:
        if how in (socket.SHUT_WR, socket.SHUT_RDWR):
            self._close_pipe(self._out)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_pipe(self._out)
        self._close_pipe(self._in)

    def _close_pipe(self, pipe: _Pipe) -> None:
        if rt.current_runtime() is None or rt._registered() is None:
            pipe.closed = True  # the schedule is over: nobody waits on it
            return
        with pipe.changed:
            pipe.closed = True
            pipe.changed.notify_all()

    def detach(self) -> int:
        return -1

    def __enter__(self) -> SimSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SocketRaw(io.RawIOBase):
    def __init__(self, sock: SimSocket, mode: str) -> None:
        super().__init__()
        self._sock = sock
        self._mode = mode

    def readable(self) -> bool:
        return "r" in self._mode

    def writable(self) -> bool:
        return "w" in self._mode

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        self._sock.sendall(data)
        return len(data)


class SimSelector:
    """``selectors.DefaultSelector`` for simulated sockets: ``select`` waits in simulated
    time for one of them to become readable."""

    def __init__(self) -> None:
        self._keys: dict[SimSocket, selectors_key] = {}

    def register(self, sock: Any, events: int, data: Any = None) -> Any:
        if not isinstance(sock, SimSocket):
            # As selectors answers a file object it cannot watch.
            raise ValueError(f"a simulated selector takes simulated sockets, found {sock!r}")  # noqa: TRY004
        key = selectors_key(sock, -1, events, data)
        self._keys[sock] = key
        return key

    def unregister(self, sock: Any) -> Any:
        return self._keys.pop(sock)

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        runtime, _ = rt._require()
        ready = [(key, 1) for sock, key in self._keys.items() if sock.readable_now()]
        if ready or (timeout is not None and timeout <= 0) or not self._keys:
            runtime.point("select")
            return ready
        # Wait on the first socket's pipe (the product registers one at a time).
        sock = next(iter(self._keys))
        pipe = sock._in
        with pipe.changed:
            pipe.changed.wait_for(sock.readable_now, timeout)
        return [(key, 1) for sock, key in self._keys.items() if sock.readable_now()]

    def close(self) -> None:
        self._keys.clear()

    def __enter__(self) -> SimSelector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def selectors_key(fileobj: Any, fd: int, events: int, data: Any) -> Any:
    import selectors

    return selectors.SelectorKey(fileobj, fd, events, data)


class _Listener:
    def __init__(self) -> None:
        self.backlog: deque[tuple[SimSocket, tuple[str, int]]] = deque()
        self.changed = SimCondition(SimLock())
        self.open = True


class SimNet:
    """The simulated loopback network of one runtime."""

    def __init__(self, runtime: rt.Runtime) -> None:
        self._runtime = runtime
        self._listeners: dict[int, _Listener] = {}
        self._next_port = _FIRST_PORT
        self._next_client_port = 50000
        self.connections = 0

    def listen(self, port: int) -> tuple[int, _Listener]:
        if port == 0:
            port = self._next_port
            self._next_port += 1
        found = self._listeners.get(port)
        if found is not None and found.open:
            raise OSError(errno.EADDRINUSE, f"Address already in use (simulated port {port})")
        listener = _Listener()
        self._listeners[port] = listener
        return port, listener

    def connect(self, address: tuple[str, int], timeout: float | None) -> SimSocket:
        """A connection to ``address`` (a scheduling point), or ``ConnectionRefusedError``."""
        self._runtime.point("connect")
        host, port = address
        listener = self._listeners.get(int(port))
        if host not in ("127.0.0.1", "localhost") or listener is None or not listener.open:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused (simulated)")
        up, down = _Pipe(), _Pipe()
        client_port = self._next_client_port
        self._next_client_port += 1
        client = SimSocket(self, down, up, ("127.0.0.1", int(port)))
        server = SimSocket(self, up, down, ("127.0.0.1", client_port))
        client.settimeout(timeout)
        self.connections += 1
        with listener.changed:
            listener.backlog.append((server, ("127.0.0.1", client_port)))
            listener.changed.notify_all()
        return client

    def connection_class(self) -> type[http.client.HTTPConnection]:
        """``http.client.HTTPConnection`` connecting through this network (the real one for
        a thread the runtime does not know)."""
        net = self

        class SimHTTPConnection(http.client.HTTPConnection):
            def connect(self) -> None:
                if rt._registered() is None:
                    super().connect()
                    return
                self.sock = net.connect((self.host, self.port), self.timeout)  # type: ignore[assignment]

        return SimHTTPConnection

    def server_class(self, base: type[socketserver.BaseServer]) -> type[Any]:
        """``base`` (a ``socketserver`` server class, threading or not) listening on this
        network; each connection is served on a registered thread."""
        made = type(base.__name__, (_SimServer, base), {"_net": self})
        made.__qualname__ = base.__qualname__
        return made


class _SimServer:
    """What :meth:`SimNet.server_class` puts in front of a ``socketserver`` server class."""

    _net: SimNet

    def __init__(
        self, server_address: tuple[str, int], handler: Any, bind_and_activate: bool = True
    ) -> None:
        if rt._registered() is None:
            raise RuntimeError("a simulated server is made by a thread of the schedule")
        socketserver.BaseServer.__init__(self, server_address, handler)  # type: ignore[arg-type]
        host = server_address[0]
        port, self._listener = self._net.listen(int(server_address[1]))
        self.server_address = (host, port)
        self.server_name = host
        self.server_port = port
        self.socket = _ClosedSocket(self)
        self._stopping = False
        self._stopped = SimEvent()
        self._stopped.set()

    def fileno(self) -> int:
        return -1

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        listener = self._listener
        try:
            while not self._stopping:
                with listener.changed:
                    listener.changed.wait_for(
                        lambda: listener.backlog or self._stopping or not listener.open,
                        poll_interval,
                    )
                    taken = listener.backlog.popleft() if listener.backlog else None
                if taken is not None:
                    self.process_request(*taken)
                elif not listener.open:
                    break
        finally:
            self._stopping = False
            self._stopped.set()

    def shutdown(self) -> None:
        self._stopping = True
        listener = self._listener
        with listener.changed:
            listener.changed.notify_all()
        self._stopped.wait()

    def process_request(self, request: Any, client_address: Any) -> None:
        name = f"{type(self).__name__}-request"
        thread = rt.SimThread(target=self._serve_one, args=(request, client_address), name=name)
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        server: Any = self
        try:
            # A client that went away mid-request (socketserver would print its traceback).
            with contextlib.suppress(Exception):
                server.finish_request(request, client_address)
        finally:
            server.shutdown_request(request)

    def server_close(self) -> None:
        listener = self._listener
        listener.open = False
        backlog = list(listener.backlog)
        listener.backlog.clear()
        for sock, _ in backlog:
            sock.close()
        if rt._registered() is not None:
            with listener.changed:
                listener.changed.notify_all()


class _ClosedSocket:
    """What a simulated server has for ``socket``: closing it stops the listening."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def close(self) -> None:
        self._server._listener.open = False

    def fileno(self) -> int:
        return -1
