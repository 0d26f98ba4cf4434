"""The schedule's locks, conditions, events, semaphores, futures and thread pools.

Each is what its ``threading`` or ``concurrent.futures`` namesake is to the product, on the
runtime of :mod:`tests.system.runtime`: acquiring, waiting and joining are scheduling points, a
timeout is simulated time, and a thread that must wait gives the baton on. Only the runtime's
threads may use them (another raises). During a schedule the product gets them through the
stand-ins of :mod:`tests.system.standins`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tests.system.runtime import (
    _BLOCKED,
    Killed,
    SimThread,
    _registered,
    _require,
    current_runtime,
)

__all__ = [
    "SimBoundedSemaphore",
    "SimCondition",
    "SimEvent",
    "SimExecutor",
    "SimFuture",
    "SimLock",
    "SimRLock",
    "SimSemaphore",
    "sim_as_completed",
    "sim_wait",
]

logger = logging.getLogger(__name__)


class SimLock:
    """``threading.Lock``: acquiring is a scheduling point."""

    _reentrant = False

    def __init__(self) -> None:
        self._owner: SimThread | None = None
        self._count = 0
        self._waiters: deque[SimThread] = deque()

    def __repr__(self) -> str:
        owner = self._owner.name if self._owner is not None else None
        return f"<{type(self).__name__} owner={owner}>"

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        runtime, me = _require()
        runtime.point("lock")
        if self._owner is me and self._reentrant:
            self._count += 1
            return True
        if self._owner is None:
            self._owner, self._count = me, 1
            return True
        if not blocking:
            return False
        deadline = runtime._deadline(None if timeout is None or timeout < 0 else timeout)
        while self._owner is not None:
            self._waiters.append(me)
            holder = self._owner.name
            woke = runtime._block(me, f"{type(self).__name__[3:]} held by {holder}", deadline)
            if me in self._waiters:
                self._waiters.remove(me)
            if not woke and self._owner is not None and runtime._passed(deadline):
                return False
        self._owner, self._count = me, 1
        return True

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        found = _registered()
        me = found[1] if found is not None else None
        if self._owner is None:
            if me is not None and me.killed:
                return
            raise RuntimeError("release unlocked lock")
        if self._reentrant:
            if self._owner is not me:
                if me is not None and me.killed:
                    return
                raise RuntimeError("cannot release un-acquired lock")
            self._count -= 1
            if self._count:
                return
        self._owner, self._count = None, 0
        self._wake_one()

    def _wake_one(self) -> None:
        """Wake the first waiter still blocked (one that timed out takes no wake-up)."""
        runtime = current_runtime()
        while self._waiters and runtime is not None:
            thread = self._waiters.popleft()
            if thread.state is _BLOCKED:
                runtime._wake(thread)
                return

    def locked(self) -> bool:
        return self._owner is not None

    def _is_owned(self) -> bool:
        found = _registered()
        return found is not None and self._owner is found[1]

    def _release_save(self) -> tuple[SimThread | None, int]:
        state = (self._owner, self._count)
        self._owner, self._count = None, 0
        self._wake_one()
        return state

    def _acquire_restore(self, state: tuple[SimThread | None, int]) -> None:
        self.acquire()
        self._count = state[1]


class SimRLock(SimLock):
    """``threading.RLock``."""

    _reentrant = True


class SimCondition:
    """``threading.Condition`` on a :class:`SimLock` (a new :class:`SimRLock` by default)."""

    def __init__(self, lock: SimLock | None = None) -> None:
        if lock is None:
            lock = SimRLock()
        if not isinstance(lock, SimLock):
            raise TypeError(f"a simulated condition needs a simulated lock, found {lock!r}")
        self._lock = lock
        self._waiters: deque[SimThread] = deque()
        self.acquire = lock.acquire
        self.release = lock.release

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        runtime, me = _require()
        if not self._lock._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        saved = self._lock._release_save()
        self._waiters.append(me)
        try:
            woke = runtime._block(me, "Condition.wait", runtime._deadline(timeout))
        finally:
            if me in self._waiters:
                self._waiters.remove(me)
            self._lock._acquire_restore(saved)
        return woke

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        runtime, _ = _require()
        deadline = runtime._deadline(timeout)
        result = predicate()
        while not result:
            if deadline is not None:
                left = deadline - runtime.now()
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        runtime, _ = _require()
        if not self._lock._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        for _ in range(min(n, len(self._waiters))):
            runtime._wake(self._waiters.popleft())

    def notify_all(self) -> None:
        self.notify(len(self._waiters))

    notifyAll = notify_all


class SimEvent:
    """``threading.Event``: waiting is a scheduling point."""

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[SimThread] = []

    def is_set(self) -> bool:
        return self._flag

    isSet = is_set

    def set(self) -> None:
        self._flag = True
        runtime = current_runtime()
        waiters, self._waiters = self._waiters, []
        if runtime is not None:
            for thread in waiters:
                runtime._wake(thread)

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        runtime, me = _require()
        runtime.point("event")
        if self._flag:
            return True
        deadline = runtime._deadline(timeout)
        while not self._flag:
            if deadline is not None and runtime._passed(deadline):
                break
            self._waiters.append(me)
            runtime._block(me, "Event.wait", deadline)
            if me in self._waiters:
                self._waiters.remove(me)
        return self._flag


class SimSemaphore:
    """``threading.Semaphore``."""

    def __init__(self, value: int = 1) -> None:
        self._value = value
        self._cond = SimCondition(SimLock())

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._cond:
            if not blocking and self._value <= 0:
                return False
            if not self._cond.wait_for(lambda: self._value > 0, timeout):
                return False
            self._value -= 1
            return True

    __enter__ = acquire

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._value += n
            self._cond.notify(n)

    def __exit__(self, *exc: object) -> None:
        self.release()


class SimBoundedSemaphore(SimSemaphore):
    """``threading.BoundedSemaphore``."""


# -- futures and executors --------------------------------------------------------------------

_PENDING, _RUNNING, _CANCELLED, _DONE = "PENDING", "RUNNING", "CANCELLED", "FINISHED"


class SimFuture:
    """``concurrent.futures.Future`` on the runtime's primitives."""

    def __init__(self) -> None:
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._event = SimEvent()
        self._callbacks: list[Callable[[SimFuture], object]] = []
        self._watchers: list[SimEvent] = []

    def __repr__(self) -> str:
        return f"<SimFuture {self._state}>"

    def cancel(self) -> bool:
        if self._state in (_RUNNING, _DONE):
            return False
        if self._state != _CANCELLED:
            self._state = _CANCELLED
            self._settled()
        return True

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def running(self) -> bool:
        return self._state == _RUNNING

    def done(self) -> bool:
        return self._state in (_CANCELLED, _DONE)

    def set_running_or_notify_cancel(self) -> bool:
        if self._state == _CANCELLED:
            return False
        self._state = _RUNNING
        return True

    def set_result(self, result: Any) -> None:
        self._result = result
        self._state = _DONE
        self._settled()

    def set_exception(self, exception: BaseException | None) -> None:
        self._exception = exception
        self._state = _DONE
        self._settled()

    def _settled(self) -> None:
        self._event.set()
        for watcher in self._watchers:
            watcher.set()
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:
                import logging

                logging.getLogger(__name__).exception("future callback failed")

    def add_done_callback(self, fn: Callable[[SimFuture], object]) -> None:
        if self.done():
            fn(self)
        else:
            self._callbacks.append(fn)

    def _wait(self, timeout: float | None) -> None:
        if not self._event.wait(timeout):
            raise concurrent.futures.TimeoutError()

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        return self._exception


def sim_wait(
    fs: Iterable[SimFuture],
    timeout: float | None = None,
    return_when: str = concurrent.futures.ALL_COMPLETED,
) -> concurrent.futures._base.DoneAndNotDoneFutures[Any]:
    """``concurrent.futures.wait``."""
    runtime, _ = _require()
    futures = set(fs)
    deadline = runtime._deadline(timeout)

    def split() -> tuple[set[SimFuture], set[SimFuture]]:
        done = {f for f in futures if f.done()}
        return done, futures - done

    done, pending = split()
    while pending:
        if return_when == concurrent.futures.FIRST_COMPLETED and done:
            break
        if return_when == concurrent.futures.FIRST_EXCEPTION and any(
            not f.cancelled() and f._exception is not None for f in done
        ):
            break
        watcher = SimEvent()
        for future in pending:
            future._watchers.append(watcher)
        left = None if deadline is None else deadline - runtime.now()
        if left is not None and left <= 0:
            break
        watcher.wait(left)
        for future in pending:
            if watcher in future._watchers:
                future._watchers.remove(watcher)
        done, pending = split()
    return concurrent.futures._base.DoneAndNotDoneFutures(done, pending)


def sim_as_completed(fs: Iterable[SimFuture], timeout: float | None = None) -> Iterator[SimFuture]:
    """``concurrent.futures.as_completed``."""
    pending = set(fs)
    while pending:
        done, pending = sim_wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)
        if not done:
            raise concurrent.futures.TimeoutError()
        yield from done


class SimExecutor:
    """``concurrent.futures.ThreadPoolExecutor`` on registered threads."""

    def __init__(
        self,
        max_workers: int | None = None,
        thread_name_prefix: str = "",
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        self._max = max_workers or 4
        self._prefix = thread_name_prefix or "SimExecutor"
        self._initializer = initializer
        self._initargs = initargs
        self._cond = SimCondition(SimLock())
        self._work: deque[tuple[SimFuture, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
        self._work = deque()
        self._threads: list[SimThread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> SimFuture:
        future = SimFuture()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.append((future, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._max:
                thread = SimThread(target=self._worker, name=f"{self._prefix}_{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._cond.notify()
        return future

    def _worker(self) -> None:
        if self._initializer is not None:
            self._initializer(*self._initargs)
        while True:
            with self._cond:
                while not self._work and not self._shutdown:
                    self._idle += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._idle -= 1
                if not self._work:
                    return
                future, fn, args, kwargs = self._work.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:
                future.set_exception(err)
                if isinstance(err, Killed):
                    raise
            else:
                future.set_result(result)

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[Any]:
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=False)]

        def results() -> Iterator[Any]:
            for future in futures:
                yield future.result(timeout)

        return results()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._work:
                    self._work.popleft()[0].cancel()
            self._cond.notify_all()
        if wait:
            for thread in list(self._threads):
                thread.join()

    def __enter__(self) -> SimExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)
