"""A deterministic runtime for the whole-system checker: real threads, one at a time.

Every thread the product starts during a schedule is a real OS thread, but it runs only while
it holds the *baton*: exactly one registered thread runs at any moment, and it hands the baton
on at each **scheduling point** — acquiring a lock, waiting on a condition, an event, a future
or a thread, sleeping, and each store request (:meth:`Runtime.point`, called by the simulated
store). There a seeded random generator picks which runnable thread goes next, so a seed fixes
the interleaving of every thread, and any actor can act between any two requests of another.

Time is simulated: a timed wait is a deadline on the simulated clock, and the clock moves on
only when no thread can run (it jumps to the earliest deadline), or when the schedule moves it.
No wall-clock wait decides an outcome. When no thread can run and none waits with a deadline,
the runtime raises :class:`SimDeadlock` in the main thread, naming every blocked thread and
what it waits for.

The product is made to use it without being rewritten: for the duration of a schedule,
:class:`Runtime` replaces, in the globals of every loaded ``millpond.*`` module (found through
``sys.modules``, so modules that move keep working), ``threading``, ``time`` (``sleep`` and the
monotonic clocks; the wall clock stays real), the names imported from ``concurrent.futures``,
``selectors`` and ``http`` (``http.client.HTTPConnection``: see :mod:`tests.system.simnet`),
and any ``SystemClock`` (a clock nobody injected reads the schedule's time) with
scheduler-aware stand-ins; dataclass fields defaulting to a ``threading`` primitive get the
stand-in too, and ``socketserver`` servers defined there listen on the simulated network. So
that a seed also fixes what the product draws at random, ``random``, ``os.urandom``,
``uuid.uuid4`` and ``secrets`` draw from a generator seeded with it. ``os.fsync`` and
``os.fdatasync`` return at once: a simulated crash loses nothing the page cache holds, and a
real sync would hold the baton for its whole latency. The stand-ins give the real thing to a
thread the runtime does not know (a leftover of another test), so only the schedule's own
threads are simulated. Everything is put back when the schedule ends; the threads still alive
then are ended by raising :class:`Killed` at their scheduling points (their ``finally`` blocks
run). ``millpond.storage.obstore_store`` is left alone: the store itself is the world, not an
actor (its requests are atomic; the roles' views of it are the scheduling points).

A thread that must not be interrupted between two points — a sink transaction, which holds
SQLite's write lock: another thread's write would wait for it in C, in real time — runs inside
:meth:`Runtime.atomic`: its scheduling points do not switch threads, and blocking there is an
error.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import dataclasses
import http
import http.client
import os
import random
import secrets
import selectors
import socketserver
import sys
import threading
import time
import types
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = [
    "Killed",
    "Lanes",
    "Runtime",
    "SimDeadlock",
    "SimLivelock",
    "current_runtime",
]

_NEW, _RUNNABLE, _BLOCKED, _FINISHED = "new", "runnable", "blocked", "finished"

_ACTIVE: Runtime | None = None


def current_runtime() -> Runtime | None:
    """The runtime of the schedule running now, if any."""
    return _ACTIVE


def _registered() -> tuple[Runtime, SimThread] | None:
    """The active runtime and the calling thread's record, when the caller is one of its
    threads."""
    runtime = _ACTIVE
    if runtime is None:
        return None
    me = runtime._by_ident.get(_thread.get_ident())
    if me is None:
        return None
    return runtime, me


class Killed(BaseException):
    """Raised in a thread still alive when its schedule ends, at its scheduling point."""


class SimDeadlock(RuntimeError):
    """No thread can run and none waits with a deadline."""


class SimLivelock(RuntimeError):
    """The schedule took more scheduling steps than its limit."""


class SimThread:
    """A registered thread: a real OS thread that runs only while it holds the baton.

    The interface of ``threading.Thread`` that millpond uses (``start``, ``join``,
    ``is_alive``, ``name``, ``daemon``, ``ident``); a subclass may override :meth:`run`.
    """

    def __init__(
        self,
        group: None = None,
        target: Callable[..., object] | None = None,
        name: str | None = None,
        args: Iterable[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        daemon: bool | None = None,
        _runtime: Runtime | None = None,
    ) -> None:
        runtime = _runtime or _ACTIVE
        if runtime is None:
            raise RuntimeError("a simulated thread needs an active runtime")
        self._runtime = runtime
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self.number = runtime._next_number()
        self.name = name or f"SimThread-{self.number}"
        self.daemon = True if daemon is None else daemon
        self.state = _NEW
        self.ident: int | None = None
        self.native_id: int | None = None
        self.deadline: float | None = None
        self.woken = False
        self.waiting_for = ""
        self.pending: BaseException | None = None
        self.killed = False
        self._baton = _thread.allocate_lock()
        self._baton.acquire()
        self._joiners: list[SimThread] = []
        self._atomic = 0
        self._on_start: list[Callable[[], None]] = [hook() for hook in runtime.spawn_hooks]

    def __repr__(self) -> str:
        return f"<SimThread {self.name} {self.state}>"

    # -- threading.Thread -------------------------------------------------------------------

    def start(self) -> None:
        runtime = self._runtime
        if self.state is not _NEW:
            raise RuntimeError("threads can only be started once")
        if runtime._tearing_down:
            self.state = _FINISHED
            return
        self.state = _RUNNABLE
        runtime._add(self)
        kind = self.name.rstrip("0123456789_-")
        runtime.started[kind] = runtime.started.get(kind, 0) + 1
        real = threading.Thread(target=self._bootstrap, name=self.name, daemon=True)
        real.start()
        found = _registered()
        if found is not None:
            found[0].point("start")

    def run(self) -> None:
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def join(self, timeout: float | None = None) -> None:
        runtime, me = _require()
        if self is me:
            raise RuntimeError("cannot join current thread")
        runtime.point("join")
        if self.state is _NEW:
            raise RuntimeError("cannot join thread before it is started")
        deadline = runtime._deadline(timeout)
        while self.state is not _FINISHED:
            self._joiners.append(me)
            woke = runtime._block(me, f"join({self.name})", deadline)
            if me in self._joiners:
                self._joiners.remove(me)
            if not woke and runtime._passed(deadline):
                return

    def is_alive(self) -> bool:
        return self.state in (_RUNNABLE, _BLOCKED)

    @property
    def alive(self) -> bool:
        return self.is_alive()

    def getName(self) -> str:
        return self.name

    # -- the OS thread ----------------------------------------------------------------------

    def _first_turn(self) -> None:
        if self.pending is not None or self.killed:
            raise Killed(self.name)  # the schedule ended before the thread ran
        for hook in self._on_start:
            hook()

    def _bootstrap(self) -> None:
        runtime = self._runtime
        self.ident = _thread.get_ident()
        self.native_id = threading.get_native_id()
        runtime._by_ident[self.ident] = self
        runtime._ever.add(self.ident)
        self._baton.acquire()  # the first turn
        try:
            self._first_turn()
            self.run()
        except BaseException as err:
            if not self.killed and not isinstance(err, (Killed, *runtime.quiet_exceptions)):
                runtime.thread_errors.append(f"{self.name}: {err!r}")
                threading.excepthook(
                    threading.ExceptHookArgs([type(err), err, err.__traceback__, None])  # type: ignore[call-arg]
                )
        finally:
            runtime._finish(self)


def _require() -> tuple[Runtime, SimThread]:
    found = _registered()
    if found is None:
        raise RuntimeError(
            f"thread {threading.current_thread().name} is not registered with the simulation "
            "runtime but used one of its primitives"
        )
    return found


class Runtime:
    """The scheduler of one schedule: its threads, its simulated time, its seeded choices.

    ``clock`` is the simulated time line (:class:`TimeLine`: ``current()`` and
    ``jump_to(t)``); without one the runtime keeps its own. ``switch`` is the chance that a
    thread still runnable at a scheduling point gives the baton to a thread picked at random
    (itself included); a store request uses ``request_switch`` instead.
    """

    def __init__(
        self,
        seed: int,
        clock: Any = None,
        *,
        switch: float = 0.2,
        request_switch: float = 0.6,
        max_steps: int = 20_000_000,
        quiet_exceptions: tuple[type[BaseException], ...] = (),
        patch_prefixes: tuple[str, ...] = ("millpond",),
        exclude_modules: Iterable[str] = ("millpond.storage.obstore_store",),
    ) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self.data_random = random.Random(seed ^ 0x5EED5)
        """The source of everything the product draws at random (names, jitter, tokens)."""
        self._time = clock if clock is not None else _OwnTime()
        self.switch = switch
        self.request_switch = request_switch
        self.max_steps = max_steps
        self.quiet_exceptions = quiet_exceptions
        self._patch_prefixes = patch_prefixes
        self._exclude = frozenset(exclude_modules)
        self._threads: list[SimThread] = []
        self._timed: set[SimThread] = set()
        self._by_ident: dict[int, SimThread] = {}
        self._numbers = 0
        self._current: SimThread | None = None
        self._main: SimThread | None = None
        self._tearing_down = False
        self._restore: list[Callable[[], None]] = []
        self.steps = 0
        self.switches = 0
        self.thread_errors: list[str] = []
        """Exceptions that ended a thread (other than the quiet ones)."""
        self.spawn_hooks: list[Callable[[], Callable[[], None]]] = []
        """Each called in the creating thread when a thread is made; what it returns is
        called first thing in the new thread (it inherits the creator's clock readings)."""
        self.started: dict[str, int] = {}
        """How many threads of each name the schedule started (digits left out)."""
        self.foreign: list[str] = []
        """Real threads alive at the end that the runtime did not start (not scheduled)."""
        self._before: set[int | None] = set()
        self._ever: set[int | None] = set()
        self.leaked: list[str] = []
        """Threads that did not end when killed at the end of the schedule."""
        self._clock_class: type | None = None
        self.net: Any = None
        """The simulated network (:class:`tests.system.simnet.SimNet`), made on entry."""

    # -- entering and leaving ----------------------------------------------------------------

    def __enter__(self) -> Runtime:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a runtime is active already")
        from tests.system import simnet

        self.net = simnet.SimNet(self)
        main = SimThread(name="main", _runtime=self)
        main.state = _RUNNABLE
        main.ident = _thread.get_ident()
        self._main = self._current = main
        self._threads.append(main)
        self._by_ident[main.ident] = main
        self._before = {t.ident for t in threading.enumerate()}
        _ACTIVE = self
        try:
            self._patch()
        except BaseException:
            _ACTIVE = None
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        try:
            self._teardown()
        finally:
            for undo in reversed(self._restore):
                undo()
            self._restore = []
            _ACTIVE = None

    def _teardown(self) -> None:
        """End every thread still alive: each runs alone, raising :class:`Killed` at every
        scheduling point, until it ends."""
        main = self._main
        assert main is not None
        self.foreign = sorted(
            t.name
            for t in threading.enumerate()
            if t.ident not in self._before and t.ident not in self._ever and t.is_alive()
        )
        self._tearing_down = True
        for thread in list(self._threads):
            if thread is main or thread.state is _FINISHED:
                continue
            thread.killed = True
            thread.pending = Killed(thread.name)
            self._timed.discard(thread)
            thread.state = _RUNNABLE
            self._current = thread
            thread._baton.release()
            if not main._baton.acquire(timeout=30):
                self.leaked.append(thread.name)
                self._current = main
        self._threads = [t for t in self._threads if t is main]

    # -- scheduling -------------------------------------------------------------------------

    def _next_number(self) -> int:
        self._numbers += 1
        return self._numbers

    def _add(self, thread: SimThread) -> None:
        self._threads.append(thread)

    def now(self) -> float:
        return float(self._time.current())

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None:
            return None
        return self.now() + max(0.0, timeout)

    def _passed(self, deadline: float | None) -> bool:
        return deadline is not None and self.now() >= deadline

    def registered(self) -> bool:
        """Whether the calling thread is one of this runtime's."""
        return self._by_ident.get(_thread.get_ident()) is not None

    def point(self, kind: str = "point") -> None:
        """A scheduling point of the calling thread: the baton may go to another thread."""
        found = _registered()
        if found is None:
            return
        _, me = found
        if me.killed:
            raise Killed(me.name)
        self.steps += 1
        if me._atomic:
            return
        chance = self.request_switch if kind == "request" else self.switch
        self._wake_due()
        if self._rng.random() >= chance and self.steps < self.max_steps:
            return
        self._switch(me)

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for ``seconds`` of simulated time."""
        _, me = _require()
        if seconds <= 0:
            self.point("sleep")
            return
        self._block(me, f"sleep({seconds:g})", self.now() + seconds)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """The calling thread keeps the baton until the block ends (module docstring)."""
        found = _registered()
        if found is None:
            yield
            return
        _, me = found
        me._atomic += 1
        try:
            yield
        finally:
            me._atomic -= 1

    def _block(self, me: SimThread, what: str, deadline: float | None) -> bool:
        """Park ``me`` until woken (``True``) or until ``deadline`` passes (``False``)."""
        if me.killed:
            raise Killed(me.name)
        if me._atomic:
            raise RuntimeError(f"{me.name} would block inside an atomic section: {what}")
        self.steps += 1
        me.state = _BLOCKED
        me.woken = False
        me.waiting_for = what
        me.deadline = deadline
        if deadline is not None:
            self._timed.add(me)
        self._switch(me)
        return me.woken

    def _wake(self, thread: SimThread) -> None:
        """Make a blocked thread runnable (what it waited for happened)."""
        if thread.state is _BLOCKED:
            thread.state = _RUNNABLE
            thread.woken = True
            thread.deadline = None
            self._timed.discard(thread)

    def _wake_due(self) -> None:
        """Blocked threads whose deadline has come are runnable (timed out)."""
        if not self._timed:
            return
        now = self.now()
        for thread in [t for t in self._timed if t.deadline is not None and t.deadline <= now]:
            self._timed.discard(thread)
            thread.state = _RUNNABLE
            thread.deadline = None

    def _pick(self) -> SimThread | None:
        """The thread that runs next (moving time on when none can run)."""
        main = self._main
        assert main is not None
        if self._tearing_down:
            return main
        self._wake_due()
        runnable = [t for t in self._threads if t.state is _RUNNABLE]
        if not runnable and self._timed:
            earliest = min(t.deadline for t in self._timed if t.deadline is not None)
            self._time.jump_to(earliest)
            self._wake_due()
            runnable = [t for t in self._threads if t.state is _RUNNABLE]
        if self.steps >= self.max_steps and main.state is not _FINISHED:
            if main.pending is None:
                main.pending = SimLivelock(
                    f"the schedule took {self.steps} scheduling steps: {self.describe()}"
                )
            self._timed.discard(main)
            main.state = _RUNNABLE
            return main
        if not runnable:
            blocked = [t for t in self._threads if t.state is _BLOCKED]
            if not blocked:
                return None
            victim = main if main.state is _BLOCKED else blocked[0]
            victim.pending = SimDeadlock(f"no thread can run: {self.describe()}")
            victim.state = _RUNNABLE
            return victim
        if len(runnable) == 1:
            return runnable[0]
        return runnable[self._rng.randrange(len(runnable))]

    def describe(self) -> str:
        """Every live thread and what it waits for."""
        return "; ".join(
            f"{t.name} {t.state}" + (f" on {t.waiting_for}" if t.state is _BLOCKED else "")
            for t in self._threads
            if t.state is not _FINISHED
        )

    def _switch(self, me: SimThread) -> None:
        """Hand the baton to the thread :meth:`_pick` chooses; return once ``me`` has it."""
        nxt = self._pick()
        if nxt is None:
            raise SimDeadlock(f"no thread left to run: {self.describe()}")
        if nxt is not me:
            self.switches += 1
            self._current = nxt
            nxt._baton.release()
            me._baton.acquire()
        self._current = me
        pending = me.pending
        if pending is not None:
            me.pending = None
            raise pending
        if me.killed:
            raise Killed(me.name)

    def _finish(self, me: SimThread) -> None:
        """``me`` ends: wake its joiners, give the baton on, and let the OS thread go."""
        me.state = _FINISHED
        self._timed.discard(me)
        for joiner in me._joiners:
            self._wake(joiner)
        me._joiners = []
        if me in self._threads:
            self._threads.remove(me)
        self._by_ident.pop(me.ident or -1, None)
        nxt = self._pick()
        if nxt is None:
            return
        self._current = nxt
        nxt._baton.release()

    def spawn(self, target: Callable[[], object], name: str) -> SimThread:
        """Start ``target`` on a new registered thread."""
        thread = SimThread(target=target, name=name, _runtime=self)
        thread.start()
        return thread

    # -- patching the product ----------------------------------------------------------------

    def _patch(self) -> None:
        replacements = _replacements(self)
        for name, module in list(sys.modules.items()):
            if module is None or name in self._exclude:
                continue
            if not any(name == p or name.startswith(p + ".") for p in self._patch_prefixes):
                continue
            self._patch_module(module, replacements)

    def _patch_module(self, module: types.ModuleType, replacements: dict[int, Any]) -> None:
        namespace = module.__dict__
        for key, value in list(namespace.items()):
            new = replacements.get(id(value))
            if new is not None:
                namespace[key] = new
                self._restore.append(_setter(namespace, key, value))
            elif isinstance(value, type) and value.__name__ == "SystemClock":
                # A clock no one injected would read real time: the schedule's instead.
                namespace[key] = self._system_clock()
                self._restore.append(_setter(namespace, key, value))
            elif isinstance(value, type) and value.__module__ == module.__name__:
                self._patch_class(value, namespace, key, replacements)

    def _patch_class(
        self, cls: type, namespace: dict[str, Any], key: str, replacements: dict[int, Any]
    ) -> None:
        if dataclasses.is_dataclass(cls):
            init = cls.__dict__.get("__init__")
            for cell in getattr(init, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:
                    continue
                new = replacements.get(id(content))
                if new is not None:
                    cell.cell_contents = new
                    self._restore.append(_cell_setter(cell, content))
        if issubclass(cls, socketserver.BaseServer) and self.net is not None:
            namespace[key] = self.net.server_class(cls)
            self._restore.append(_setter(namespace, key, cls))

    def _system_clock(self) -> type:
        """A ``SystemClock`` on the schedule's time (the real one for a foreign thread)."""
        if self._clock_class is not None:
            return self._clock_class
        runtime = self

        class SimSystemClock:
            def now_ms(self) -> int:
                if not runtime.registered():
                    return time.time_ns() // 1_000_000
                wall = getattr(runtime._time, "now_ms", None)
                return int(wall()) if wall is not None else int(runtime.now() * 1000)

            def monotonic(self) -> float:
                return runtime.now() if runtime.registered() else time.monotonic()

            def sleep(self, seconds: float) -> None:
                if runtime.registered():
                    runtime.sleep(seconds)
                elif seconds > 0:
                    time.sleep(seconds)

        self._clock_class = SimSystemClock
        return SimSystemClock

    def patch_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` for the schedule (put back when it ends)."""
        old = (
            owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        )
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, old))


def _setter(namespace: dict[str, Any], key: str, value: Any) -> Callable[[], None]:
    def undo() -> None:
        namespace[key] = value

    return undo


def _cell_setter(cell: Any, value: Any) -> Callable[[], None]:
    def undo() -> None:
        cell.cell_contents = value

    return undo


class _OwnTime:
    def __init__(self) -> None:
        self._now = 0.0

    def current(self) -> float:
        return self._now

    def jump_to(self, moment: float) -> None:
        self._now = max(self._now, moment)


class Lanes:
    """Actors that go on while the schedule does: each lane runs its actions in order, each
    on a registered thread of its own; different lanes run concurrently. An action's
    exception (other than :class:`Killed`) goes to ``on_error``."""

    def __init__(self, runtime: Runtime, on_error: Callable[[str, BaseException], None]) -> None:
        self._runtime = runtime
        self._on_error = on_error
        self._last: dict[str, SimThread] = {}

    def run(self, lane: str, action: Callable[[], object]) -> None:
        """Run ``action`` on ``lane`` once what it runs already is done."""
        previous = self._last.get(lane)

        def body() -> None:
            if previous is not None:
                previous.join()
            try:
                action()
            except Killed:
                raise
            except BaseException as err:
                self._on_error(lane, err)

        self._last[lane] = self._runtime.spawn(body, lane)

    def wait(self, lane: str, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` simulated seconds) for what ``lane`` runs."""
        last = self._last.get(lane)
        if last is not None:
            last.join(timeout)

    def settle(self, seconds: float) -> None:
        """Wait until every lane is idle, or ``seconds`` of simulated time have passed."""
        deadline = self._runtime.now() + seconds
        for last in list(self._last.values()):
            left = deadline - self._runtime.now()
            if left <= 0:
                return
            last.join(left)

    def drain(self) -> None:
        """Wait until every lane is idle."""
        for last in list(self._last.values()):
            last.join()

    def busy(self) -> list[str]:
        return [lane for lane, last in self._last.items() if last.is_alive()]


# -- the primitives ---------------------------------------------------------------------------


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
        runtime = _ACTIVE
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
        runtime = _ACTIVE
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


# -- the stand-ins put into the product's modules ---------------------------------------------


def _dispatch(sim: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """``sim`` for the runtime's threads, ``real`` for any other (another test's leftover)."""

    def make(*args: Any, **kwargs: Any) -> Any:
        if _registered() is not None:
            return sim(*args, **kwargs)
        return real(*args, **kwargs)

    make.__name__ = getattr(real, "__name__", "stand_in")
    return make


def _proxy(name: str, original: types.ModuleType, **overrides: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(original.__dict__)
    module.__dict__.update(overrides)
    return module


def _current_thread() -> Any:
    found = _registered()
    return found[1] if found is not None else threading.current_thread()


def _main_thread() -> Any:
    runtime = _ACTIVE
    if runtime is not None and runtime._main is not None:
        return runtime._main
    return threading.main_thread()


def _no_sync(fd: int) -> None:
    os.fstat(fd)  # a closed descriptor still fails, as it would


def _replacements(runtime: Runtime) -> dict[int, Any]:
    """By the identity of what a module imported: what it sees during the schedule."""
    from tests.system import simnet

    def monotonic() -> float:
        return runtime.now() if _registered() is not None else time.monotonic()

    def sleep(seconds: float) -> None:
        if _registered() is not None:
            runtime.sleep(seconds)
        else:
            time.sleep(seconds)

    def ns() -> int:
        return int(monotonic() * 1e9)

    sim_threading = _proxy(
        "threading",
        threading,
        Thread=_dispatch(SimThread, threading.Thread),
        Lock=_dispatch(SimLock, threading.Lock),
        RLock=_dispatch(SimRLock, threading.RLock),
        Condition=_dispatch(SimCondition, threading.Condition),
        Event=_dispatch(SimEvent, threading.Event),
        Semaphore=_dispatch(SimSemaphore, threading.Semaphore),
        BoundedSemaphore=_dispatch(SimBoundedSemaphore, threading.BoundedSemaphore),
        current_thread=_current_thread,
        currentThread=_current_thread,
        main_thread=_main_thread,
    )
    sim_time = _proxy(
        "time",
        time,
        sleep=sleep,
        monotonic=monotonic,
        perf_counter=monotonic,
        monotonic_ns=ns,
        perf_counter_ns=ns,
    )
    rng = runtime.data_random
    sim_random = _proxy("random", random)
    for name in (
        "random",
        "uniform",
        "randint",
        "randrange",
        "choice",
        "choices",
        "shuffle",
        "sample",
        "getrandbits",
        "gauss",
        "expovariate",
        "triangular",
        "betavariate",
        "normalvariate",
        "lognormvariate",
        "randbytes",
    ):
        setattr(sim_random, name, getattr(rng, name))
    # A simulated crash loses nothing the page cache holds (only a power loss would), so the
    # schedule's syncs are not waited for: a real one holds the baton for its whole latency.
    sim_os = _proxy(
        "os", os, urandom=lambda n: rng.randbytes(n), fsync=_no_sync, fdatasync=_no_sync
    )
    sim_uuid = _proxy("uuid", uuid, uuid4=lambda: uuid.UUID(int=rng.getrandbits(128), version=4))
    sim_secrets = _proxy(
        "secrets",
        secrets,
        token_bytes=lambda n=32: rng.randbytes(n),
        token_hex=lambda n=32: rng.randbytes(n).hex(),
        randbits=rng.getrandbits,
        randbelow=lambda n: rng.randrange(n),
        choice=rng.choice,
    )
    executor = _dispatch(SimExecutor, concurrent.futures.ThreadPoolExecutor)
    future = _dispatch(SimFuture, concurrent.futures.Future)
    wait = _dispatch(sim_wait, concurrent.futures.wait)
    as_completed = _dispatch(sim_as_completed, concurrent.futures.as_completed)
    sim_futures = _proxy(
        "concurrent.futures",
        concurrent.futures,
        ThreadPoolExecutor=executor,
        Future=future,
        wait=wait,
        as_completed=as_completed,
    )
    sim_concurrent = types.ModuleType("concurrent")
    sim_concurrent.futures = sim_futures  # type: ignore[attr-defined]
    sim_client = _proxy("http.client", http.client, HTTPConnection=runtime.net.connection_class())
    sim_http = _proxy("http", http, client=sim_client)
    sim_selectors = _proxy(
        "selectors",
        selectors,
        DefaultSelector=simnet.SimSelector,
        SelectSelector=simnet.SimSelector,
        PollSelector=simnet.SimSelector,
        EpollSelector=simnet.SimSelector,
    )
    table: dict[Any, Any] = {
        threading: sim_threading,
        threading.Thread: sim_threading.Thread,
        threading.Lock: sim_threading.Lock,
        threading.RLock: sim_threading.RLock,
        threading.Condition: sim_threading.Condition,
        threading.Event: sim_threading.Event,
        threading.Semaphore: sim_threading.Semaphore,
        threading.current_thread: _current_thread,
        time: sim_time,
        time.sleep: sleep,
        time.monotonic: monotonic,
        time.perf_counter: monotonic,
        random: sim_random,
        os: sim_os,
        uuid: sim_uuid,
        secrets: sim_secrets,
        concurrent.futures: sim_futures,
        concurrent.futures.ThreadPoolExecutor: executor,
        concurrent.futures.Future: future,
        concurrent.futures.wait: wait,
        concurrent.futures.as_completed: as_completed,
        http: sim_http,
        http.client: sim_client,
        http.client.HTTPConnection: sim_client.HTTPConnection,
        selectors: sim_selectors,
    }
    import concurrent as concurrent_package

    table[concurrent_package] = sim_concurrent
    return {id(key): value for key, value in table.items()}
