"""One schedule run under the deterministic runtime: the world, its threads, its time.

:func:`simulate` makes the simulated clock and the :class:`~tests.system.runtime.Runtime`
(seeded from the schedule's seed), enters it — from then on every thread the product starts is
scheduled by the seed, every timed wait is simulated time, the coordinator's HTTP runs over
the simulated network — builds the :class:`~tests.system.world.World`, runs the events, heals,
checks, and ends every thread still alive. What it returns was read inside (counters of the
product take the runtime's locks).

A sink transaction runs atomically (no thread switch inside it): it holds SQLite's write lock,
and another thread's write would otherwise wait for it in C, in real time, while the holder
cannot run. A transaction that takes more than a few real seconds is reported all the same.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from millpond.consumer.sinks import AdbcSink
from tests.system.runtime import Runtime
from tests.system.sim import SimClock, SimulatedCrash, inherit_clock_readings
from tests.system.world import Event, World, schedule

__all__ = ["Run", "simulate"]

_T = TypeVar("_T")
_MAX_STEPS = 2_000_000  # scheduling steps: seeds 0-99 take 1,900 to 11,600 (median 3,800)
_SLOW_TRANSACTION = 5.0  # real seconds: a sink transaction waited on something it cannot see


@dataclass
class Run:
    """What one schedule did."""

    seed: int
    events: list[Event]
    world: World | None = None
    trace: list[str] = field(default_factory=list)
    """Every store request in the order sent, with its answer."""
    steps: int = 0
    switches: int = 0
    simulated_seconds: float = 0.0
    inspected: Any = None
    """What ``inspect`` returned."""
    started: dict[str, int] = field(default_factory=dict)
    """Threads the runtime scheduled, by name."""
    foreign: list[str] = field(default_factory=list)
    """Threads started during the schedule that the runtime did not schedule."""
    thread_errors: list[str] = field(default_factory=list)


def simulate(
    seed: int,
    directory: Path,
    events: list[Event] | None = None,
    *,
    check: bool = True,
    inspect: Callable[[World], _T] | None = None,
    on_world: Callable[[World], None] | None = None,
) -> Run:
    """Run the schedule of ``seed`` (or ``events``) in ``directory``.

    ``on_world`` is called once the world exists (a caller that must report a failure wants
    it); ``inspect`` inside the runtime after the checks.

    Raises:
        AssertionError: a guarantee broke (the checks), a sink transaction was slow, or a
            product thread ran outside the runtime.
        SimDeadlock, SimLivelock: the threads could not go on.
    """
    run = Run(seed, events if events is not None else schedule(seed))
    clock = SimClock()
    # How eagerly the scheduler switches threads, a draw of its own: rarely (long runs of
    # one thread, as on an idle machine) to at nearly every point.
    policy = random.Random(seed ^ 0x5C4ED)
    runtime = Runtime(
        seed ^ 0xD57,
        clock,
        switch=policy.choice([0.05, 0.2, 0.5]),
        request_switch=policy.choice([0.3, 0.6, 0.9]),
        max_steps=_MAX_STEPS,
        quiet_exceptions=(SimulatedCrash,),
    )
    runtime.spawn_hooks.append(inherit_clock_readings)
    slow: list[str] = []
    try:
        with runtime:
            _atomic_sink_transactions(runtime, slow)
            world = World(seed, directory, clock=clock)
            run.world = world
            if on_world is not None:
                on_world(world)
            world.run(run.events)
            world.violations.extend(slow)
            if check:
                world.check()
            if inspect is not None:
                run.inspected = inspect(world)
        # A product thread the runtime did not start (a module it could not patch) would run
        # on real time, and a seed would not replay.
        unscheduled = [name for name in runtime.foreign if name.startswith("millpond")]
        assert not unscheduled, f"threads the runtime did not schedule: {unscheduled}"
    finally:
        run.steps, run.switches = runtime.steps, runtime.switches
        run.started, run.foreign = dict(runtime.started), list(runtime.foreign)
        run.thread_errors = list(runtime.thread_errors)
        run.simulated_seconds = clock.current()
        if run.world is not None:
            run.trace = run.world.recorder.trace
    return run


def _atomic_sink_transactions(runtime: Runtime, slow: list[str]) -> None:
    original = AdbcSink._transaction_once

    def atomically(self: AdbcSink, work: Callable[[Any], _T]) -> _T:
        started = time.monotonic()
        try:
            with runtime.atomic():
                return original(self, work)
        finally:
            took = time.monotonic() - started
            if took > _SLOW_TRANSACTION:
                slow.append(f"a sink transaction took {took:.1f} s of real time")

    runtime.patch_attribute(AdbcSink, "_transaction_once", atomically)
