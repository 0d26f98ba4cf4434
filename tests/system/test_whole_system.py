"""The whole-system checker: seeded schedules of faults against every role at once.

Each schedule (``tests/system/world.py``) runs real producers with WAL directories, real
consumers and the consumer service into a real SQLite sink, the garbage collector and a Spark
stream's commit protocol against one store, with faults the seed chooses; then it heals and
checks every invariant of ``tests/invariants.py``.

* CI runs ``MILLPOND_CHECKER_SCHEDULES`` schedules (default 100), seeds 0, 1, 2, ...
* A third of the seeds (``seed % 3 == 2``) run queue A's producers through a real
  ``millpond coordinator`` (an ``AppendCoordinator`` served over loopback HTTP, with a token
  every role sends from its ``MILLPOND_COORDINATOR_TOKEN``), which the
  schedule crashes, restarts and faults; the producers fall back to appending directly.
  Queue A's consumers send their dequeues through it too, and dequeue directly when it does
  not answer ``dequeued``.
* Half the seeds (their own draw, ``paces_fairly``) pace queue A's producers with the
  ``aging`` strategy (issue 11): a lost race reads at once, writes at once when younger
  batches won and lets older ones go first; the producers' clocks are skewed by up to 20 s,
  so the batch ages they compare disagree. Any producer that loses a race takes the batches
  uploaded meanwhile into its next write (conflict-aware group commit).
* Half the seeds without that coordinator (their own draw, ``hosts_coordinator``) have queue
  A's producers share one that the first of them to append hosts
  (``ProducerConfig.host_coordinator``); a producer's crash kills the coordinator it hosts
  (its lock released, its URL left behind), and the other producer hosts the next one.
* ``make soak`` runs many more (``MILLPOND_CHECKER_SCHEDULES=1000``, seeds from
  ``MILLPOND_CHECKER_FIRST_SEED``).
* ``MILLPOND_CHECKER_SEED=<seed>`` replays one schedule and prints its events.

The store holds the documented timing assumption (README "Guarantees"): a manifest write of a
producer, the coordinator or a Spark driver lands within ``grace period - reupload_after`` of the
clock reading it was sent on, or never (``RoleStore._in_time``). Without it a producer thread
descheduled between its deadline check and its write, while the schedule moves the clock 200 s,
would land a write no real store lets live that long.

A failure prints the seed and the event list: the schedule replays with the same faults in the
same order (threads inside one producer may still interleave differently).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from millpond.coordinator.wire import TOKEN_ENV
from tests.system.roles import TOKEN
from tests.system.world import World, coordinated, hosts_coordinator, paces_fairly, schedule

_COUNT = int(os.environ.get("MILLPOND_CHECKER_SCHEDULES", "100"))
_FIRST = int(os.environ.get("MILLPOND_CHECKER_FIRST_SEED", "0"))
_ONE = os.environ.get("MILLPOND_CHECKER_SEED")
SEEDS = [int(_ONE)] if _ONE is not None else list(range(_FIRST, _FIRST + _COUNT))


@pytest.mark.parametrize("seed", SEEDS)
def test_schedule_keeps_every_guarantee(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILLPOND_RUN_DIR", str(tmp_path / "run"))  # host coordinators' files
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the coordinator's, sent by every role
    events = schedule(seed)
    world = World(seed, tmp_path)
    try:
        world.run(events)
        world.check()
    except BaseException as err:
        trace = "\n".join(f"  {i + 1:>3}. {event}" for i, event in enumerate(events))
        named = set(re.findall(r"[\w/-]+\.batch", str(err)))
        history = "\n".join(f"  {event}" for event in world.recorder.objects if event.path in named)
        raise AssertionError(
            f"schedule {seed} broke a guarantee: {err}\n"
            f"replay: MILLPOND_CHECKER_SEED={seed} make test PYTEST_ARGS='tests/system'\n"
            f"events:\n{trace}\n"
            f"what the store did to the batch objects named above, in order:\n{history}\n"
            f"manifest writes that outlived the timing assumption (never landed): "
            f"{world.recorder.late or 'none'}"
        ) from err


# (kind, seeds run, schedules that must append through the coordinator, that must dequeue
# through it): seeds 0-59 did in 18 and 11 of 20 standalone schedules, 19 of 20 hosted ones.
_THROUGH_THE_COORDINATOR = [("standalone", 12, 9, 3), ("hosted", 6, 4, 0)]


@pytest.mark.parametrize(("kind", "count", "appending", "dequeuing"), _THROUGH_THE_COORDINATOR)
def test_schedules_with_a_coordinator_go_through_it(
    kind: str,
    count: int,
    appending: int,
    dequeuing: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A schedule that gives queue A a coordinator proves little if everything went around it
    (refused, unreachable, misconfigured): in most of the first seeds of each kind, appends
    went through the coordinator (``coordinator_appends`` of every producer process), and in
    some of them the consumers' dequeues (``coordinator_dequeues``). Faults can keep it out of
    one schedule (seed 14 made neither), not out of most."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    chosen = coordinated if kind == "standalone" else hosts_coordinator
    seeds = [seed for seed in range(500) if chosen(seed)][:count]
    through: dict[int, tuple[int, int]] = {}
    for seed in seeds:
        directory = tmp_path / str(seed)
        monkeypatch.setenv("MILLPOND_RUN_DIR", str(directory / "run"))
        world = World(seed, directory)
        world.run(schedule(seed))
        world.check()
        through[seed] = (
            sum(producer.coordinated_appends for producer in world.producers),
            sum(consumer.coordinator_dequeues for consumer in world.consumers_a),
        )
    found = f"(appends, dequeues) through the {kind} coordinator by seed: {through}"
    assert sum(1 for a, _ in through.values() if a > 0) >= appending, found
    assert sum(1 for _, d in through.values() if d > 0) >= dequeuing, found


def test_schedules_cover_every_kind_of_fault() -> None:
    """The seeds CI runs exercise every event kind and every fault mode at least once."""
    kinds: set[str] = set()
    modes: set[str] = set()
    for seed in SEEDS if _ONE is None else range(40):
        for event in schedule(seed):
            kinds.add(str(event[0]))
            modes.update(str(part) for part in event[1:] if isinstance(part, str))
    assert kinds >= {
        "produce_flush",
        "arm_producer",
        "crash_producer",
        "restart_producer",
        "consume_with_fault",
        "takeover",
        "gc_with_fault",
        "advance",
        "outage",
        "stream_with_fault",
        "delayed_append",
        "misconfigured",
        "start_coordinator",
        "crash_coordinator",
        "restart_coordinator",
        "arm_coordinator",
        "poison",
        "takeover_at",
        "stale_restart",
    }
    assert modes >= {"fail", "land", "hold", "crash", "crash_after"}
    if _ONE is None and len(SEEDS) >= 20:
        assert {paces_fairly(seed) for seed in SEEDS} == {True, False}
    assert modes >= {"corrupt", "refuse", "operator", "auto"}  # poison, and who sets it aside
    assert modes >= {"manifest", "missing", "garbage", "service", "consumer"}  # the seams
    assert modes >= {"any", "write", "index", "dead-letter"}  # where a takeover comes in
