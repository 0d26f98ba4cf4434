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

The product is made to use it without being rewritten: for the duration of a schedule the
globals of every loaded ``millpond.*`` module see the runtime's stand-ins for ``threading``,
``time``, ``concurrent.futures``, ``http.client`` and the rest (:mod:`tests.system.standins`;
the primitives themselves in :mod:`tests.system.primitives`, the network in
:mod:`tests.system.simnet`). Everything is put back when the schedule ends; the threads still
alive then are ended by raising :class:`Killed` at their scheduling points (their ``finally``
blocks run).

A thread that must not be interrupted between two points — a sink transaction, which holds
SQLite's write lock: another thread's write would wait for it in C, in real time — runs inside
:meth:`Runtime.atomic`: its scheduling points do not switch threads, and blocking there is an
error.
"""

from __future__ import annotations

import _thread
import contextlib
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = [
    "Killed",
    "Lanes",
    "Runtime",
    "SimDeadlock",
    "SimLivelock",
    "SimThread",
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
        self.time_line = clock if clock is not None else _OwnTime()
        """The simulated time (``current()``, ``jump_to(t)``; a ``now_ms()`` if it has one is
        what a ``SystemClock`` reads during the schedule)."""
        self.switch = switch
        self.request_switch = request_switch
        self.max_steps = max_steps
        self.quiet_exceptions = quiet_exceptions
        self.patch_prefixes = patch_prefixes
        """The packages whose modules get the stand-ins (:mod:`tests.system.standins`)."""
        self.exclude_modules = frozenset(exclude_modules)
        self._threads: list[SimThread] = []
        self.time_lined: set[SimThread] = set()
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
        self.net: Any = None
        """The simulated network (:class:`tests.system.simnet.SimNet`), made on entry."""

    @property
    def main(self) -> SimThread | None:
        """The thread that entered the runtime."""
        return self._main

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
            from tests.system import standins

            standins.patch(self, self._restore)
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
            self.time_lined.discard(thread)
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
        return float(self.time_line.current())

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
            self.time_lined.add(me)
        self._switch(me)
        return me.woken

    def _wake(self, thread: SimThread) -> None:
        """Make a blocked thread runnable (what it waited for happened)."""
        if thread.state is _BLOCKED:
            thread.state = _RUNNABLE
            thread.woken = True
            thread.deadline = None
            self.time_lined.discard(thread)

    def _wake_due(self) -> None:
        """Blocked threads whose deadline has come are runnable (timed out)."""
        if not self.time_lined:
            return
        now = self.now()
        for thread in [t for t in self.time_lined if t.deadline is not None and t.deadline <= now]:
            self.time_lined.discard(thread)
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
        if not runnable and self.time_lined:
            earliest = min(t.deadline for t in self.time_lined if t.deadline is not None)
            self.time_line.jump_to(earliest)
            self._wake_due()
            runnable = [t for t in self._threads if t.state is _RUNNABLE]
        if self.steps >= self.max_steps and main.state is not _FINISHED:
            if main.pending is None:
                main.pending = SimLivelock(
                    f"the schedule took {self.steps} scheduling steps: {self.describe()}"
                )
            self.time_lined.discard(main)
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
        self.time_lined.discard(me)
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

    def patch_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` for the schedule (put back when it ends)."""
        old = (
            owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        )
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, old))


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
