"""The checker's deterministic runtime (``tests/system/runtime.py``) and network
(``tests/system/simnet.py``) on their own."""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.system.primitives import SimEvent, SimExecutor, SimLock, sim_wait
from tests.system.runtime import Killed, Runtime, SimDeadlock, SimLivelock, SimThread


def _interleaving(seed: int, workers: int = 4, steps: int = 30) -> list[str]:
    """The order in which ``workers`` threads pass ``steps`` lock acquisitions each."""
    order: list[str] = []
    with Runtime(seed) as runtime:
        lock = SimLock()

        def work(name: str) -> None:
            for i in range(steps):
                with lock:
                    order.append(f"{name}{i}")

        threads = [runtime.spawn(lambda n=f"t{k}-": work(n), f"t{k}") for k in range(workers)]
        for thread in threads:
            thread.join()
    return order


def test_a_seed_replays_the_same_interleaving() -> None:
    runs = {seed: _interleaving(seed) for seed in range(6)}
    assert all(_interleaving(seed) == runs[seed] for seed in range(6))
    assert len({tuple(order) for order in runs.values()}) > 1  # seeds differ
    # The threads really interleave: no run is one thread after another.
    for order in runs.values():
        names = [step.split("-")[0] for step in order]
        assert sum(1 for a, b in itertools.pairwise(names) if a != b) > 3


def _deadlock() -> None:
    with Runtime(1) as runtime:
        first, second = SimLock(), SimLock()
        both_hold = SimEvent()
        held: list[str] = []

        def take(mine: SimLock, theirs: SimLock, name: str) -> None:
            with mine:
                held.append(name)
                if len(held) == 2:
                    both_hold.set()
                both_hold.wait()
                with theirs:
                    pass

        a = runtime.spawn(lambda: take(first, second, "a"), "worker-a")
        b = runtime.spawn(lambda: take(second, first, "b"), "worker-b")
        a.join()
        b.join()


def test_a_deadlock_is_reported_naming_the_blocked_threads() -> None:
    with pytest.raises(SimDeadlock) as raised:
        _deadlock()
    message = str(raised.value)
    assert "worker-a blocked on Lock held by worker-b" in message
    assert "worker-b blocked on Lock held by worker-a" in message
    assert "main blocked on join(worker-a)" in message


def test_time_moves_only_when_every_thread_is_blocked() -> None:
    seen: list[tuple[str, float]] = []
    with Runtime(3) as runtime:

        def sleeper() -> None:
            runtime.sleep(5.0)
            seen.append(("woke", runtime.now()))

        def busy() -> None:
            lock = SimLock()
            for _ in range(200):
                with lock:  # a scheduling point each time, never blocked
                    seen.append(("busy", runtime.now()))

        threads = [runtime.spawn(sleeper, "sleeper"), runtime.spawn(busy, "busy")]
        for thread in threads:
            thread.join()
        assert runtime.now() == 5.0
    assert all(at == 0.0 for what, at in seen if what == "busy")
    assert ("woke", 5.0) in seen


def test_timed_waits_end_at_their_deadline_in_simulated_time() -> None:
    start = time.monotonic()
    with _patched(4) as runtime:
        event = SimEvent()
        assert event.wait(3600.0) is False
        assert runtime.now() == 3600.0
        cond = threading_module(runtime).Condition()
        with cond:
            assert cond.wait(10.0) is False
        assert runtime.now() == 3610.0
    assert time.monotonic() - start < 5  # an hour and more of waiting, in no real time


def threading_module(runtime: Runtime) -> types.ModuleType:
    """The ``threading`` the runtime puts into a patched module."""
    return _probe_module(runtime)["threading"]


_PROBE = "millpond_runtime_probe"


def _probe_module(runtime: Runtime) -> dict[str, object]:
    module = sys.modules[_PROBE]
    return module.__dict__


@pytest.fixture(autouse=True)
def _probe() -> object:
    """A module whose globals the runtime patches as it patches millpond's."""
    module = types.ModuleType(_PROBE)
    exec(
        "import threading, time, random, uuid\n"
        "from concurrent.futures import ThreadPoolExecutor, Future, wait\n",
        module.__dict__,
    )
    sys.modules[_PROBE] = module
    yield module
    del sys.modules[_PROBE]


def _patched(seed: int) -> Runtime:
    return Runtime(seed, patch_prefixes=(_PROBE,))


def test_module_globals_are_patched_for_the_schedule_and_put_back() -> None:
    _probe = sys.modules[_PROBE]
    with _patched(5):
        assert _probe.threading is not threading
        assert _probe.time is not time
        assert _probe.ThreadPoolExecutor is not concurrent.futures.ThreadPoolExecutor
        made = _probe.threading.Thread(target=lambda: None, name="x")
        assert isinstance(made, SimThread)
        assert isinstance(_probe.threading.Lock(), SimLock)
        assert isinstance(_probe.ThreadPoolExecutor(2), SimExecutor)
        first = [_probe.random.random() for _ in range(3)] + [_probe.uuid.uuid4()]
        # A thread the runtime does not know gets the real thing.
        found: list[object] = []
        other = threading.Thread(target=lambda: found.append(_probe.threading.Lock()))
        other.start()
        other.join()
        assert not isinstance(found[0], SimLock)
    assert _probe.threading is threading
    assert _probe.time is time
    assert _probe.ThreadPoolExecutor is concurrent.futures.ThreadPoolExecutor
    with _patched(5):
        assert [_probe.random.random() for _ in range(3)] + [_probe.uuid.uuid4()] == first


def test_a_module_imported_during_the_schedule_is_patched_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "millpond_runtime_lazy.py").write_text("import threading\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with Runtime(13, patch_prefixes=("millpond_runtime_lazy",)):
        import millpond_runtime_lazy

        assert millpond_runtime_lazy.threading is not threading
    assert millpond_runtime_lazy.threading is threading
    del sys.modules["millpond_runtime_lazy"]


def test_futures_and_executors_run_on_registered_threads() -> None:
    with Runtime(6) as runtime:
        with SimExecutor(2, thread_name_prefix="pool") as pool:
            slow = pool.submit(lambda: (runtime.sleep(2.0), "slow")[1])
            fast = pool.submit(lambda: "fast")
            done, _ = sim_wait([slow, fast], return_when=concurrent.futures.FIRST_COMPLETED)
            assert fast in done
            assert slow.result() == "slow"
            failing = pool.submit(lambda: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                failing.result()
            with pytest.raises(concurrent.futures.TimeoutError):
                pool.submit(lambda: runtime.sleep(10.0)).result(timeout=1.0)
            assert list(pool.map(lambda x: x * 2, [1, 2, 3])) == [2, 4, 6]
        assert runtime.now() == 12.0  # 2 s, then the 10 s sleeper the shutdown waited for


def test_threads_alive_at_the_end_are_killed_and_clean_up() -> None:
    cleaned: list[str] = []
    with Runtime(7) as runtime:

        def forever() -> None:
            try:
                SimEvent().wait()
            finally:
                cleaned.append("finally ran")

        runtime.spawn(forever, "forever")
        runtime.sleep(1.0)
    assert cleaned == ["finally ran"]
    assert runtime.leaked == []


def test_a_killed_thread_cannot_block_again() -> None:
    with Runtime(8) as runtime:

        def stubborn() -> None:
            event = SimEvent()
            for _ in range(3):
                try:
                    event.wait()
                except Killed:
                    continue

        runtime.spawn(stubborn, "stubborn")
        runtime.sleep(1.0)
    assert runtime.leaked == []


def _livelock() -> None:
    with Runtime(9, max_steps=5000) as runtime:
        lock = SimLock()

        def spin() -> None:
            while True:
                with lock:
                    pass

        runtime.spawn(spin, "spinner")
        SimEvent().wait(1.0)


def test_a_livelock_is_stopped() -> None:
    with pytest.raises(SimLivelock):
        _livelock()


def _handler(replies: list[str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30.0

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            replies.append(body.decode())
            data = body.upper()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def test_http_runs_over_the_simulated_network() -> None:
    replies: list[str] = []
    with Runtime(10) as runtime:
        server_class = runtime.net.server_class(ThreadingHTTPServer)
        server = server_class(("127.0.0.1", 0), _handler(replies))
        port = server.server_address[1]
        serving = runtime.spawn(lambda: server.serve_forever(0.05), "serving")
        connection_class = runtime.net.connection_class()
        conn = connection_class("127.0.0.1", port, timeout=5)
        for word in ("one", "two"):  # one keep-alive connection
            conn.request("POST", "/", word.encode(), {"Content-Length": str(len(word))})
            response = conn.getresponse()
            assert response.read() == word.upper().encode()
        conn.close()
        server.shutdown()
        server.server_close()
        serving.join()
        refused = connection_class("127.0.0.1", port, timeout=5)
        with pytest.raises(ConnectionRefusedError):
            refused.request("POST", "/", b"x", {"Content-Length": "1"})
        assert runtime.now() < 1.0
    assert replies == ["one", "two"]


def test_a_reply_that_never_comes_times_out_in_simulated_time() -> None:
    with Runtime(11) as runtime:
        port, listener = runtime.net.listen(0)  # accepts nothing: nobody serves
        conn = runtime.net.connection_class()("127.0.0.1", port, timeout=7.0)
        conn.request("POST", "/", b"x", {"Content-Length": "1"})
        with pytest.raises(TimeoutError):
            conn.getresponse()
        assert runtime.now() == 7.0
        assert len(listener.backlog) == 1


def test_an_unregistered_thread_cannot_use_a_simulated_primitive() -> None:
    with Runtime(12):
        lock = SimLock()
        errors: list[BaseException] = []

        def outsider() -> None:
            try:
                lock.acquire()
            except RuntimeError as err:
                errors.append(err)

        thread = threading.Thread(target=outsider)
        thread.start()
        thread.join()
    assert errors
    assert "not registered" in str(errors[0])
