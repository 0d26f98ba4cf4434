"""``BackgroundTask``: the one shape of millpond's background loops (start, stop, join, the
error that ended the body). Every wait here is on an event, never a sleep."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from millpond.common.tasks import BackgroundTask


def test_a_task_runs_its_body_on_a_named_daemon_thread_until_asked_to_stop() -> None:
    seen: list[threading.Thread] = []
    passes = threading.Event()

    def body() -> None:
        seen.append(threading.current_thread())
        while not task.wait(None):  # a pause that only a stop ends
            passes.set()
        passes.set()

    task = BackgroundTask("millpond-test-task", body)
    assert not task.running
    assert task.join(0) is True  # never started: nothing to wait for
    assert task.start() is task
    assert task.start() is task  # started once
    assert task.running
    assert not task.stopping
    assert task.stop() is True  # asked, then joined
    assert task.stopping
    assert not task.running
    assert passes.is_set()
    assert [t.name for t in seen] == ["millpond-test-task"]
    assert seen[0].daemon
    assert task.error is None


def test_stop_without_join_leaves_a_body_that_waits_for_the_callers_lock() -> None:
    lock = threading.Lock()
    waiting = threading.Event()

    def body() -> None:
        waiting.set()
        with lock:  # what the stopper holds
            assert task.stopping

    task = BackgroundTask("millpond-test-locked", body)
    with lock:
        task.start()
        assert waiting.wait(30)
        assert task.stop(join=False) is False  # joining here would wait for ever
    assert task.join(30)
    assert task.error is None


def test_a_shared_stop_event_stops_every_task_on_it_and_a_timed_join_says_what_ended() -> None:
    stop = threading.Event()
    release = threading.Event()
    tasks = [BackgroundTask(f"millpond-test-{i}", lambda: stop.wait(), stop=stop) for i in range(3)]
    stuck = BackgroundTask("millpond-test-stuck", release.wait, stop=stop)
    for task in [*tasks, stuck]:
        task.start()
    stop.set()
    assert all(task.join(30) for task in tasks)
    assert all(task.stopping for task in tasks)
    assert stuck.join(0) is False  # still in a call the stop does not end
    release.set()
    assert stuck.join(30)


def test_the_error_that_ends_a_body_is_kept_and_given_to_on_error_once() -> None:
    reported: list[tuple[str, BaseException]] = []
    boom = RuntimeError("boom")

    def body() -> None:
        raise boom

    task = BackgroundTask(
        "millpond-test-error",
        body,
        on_error=lambda err: reported.append((threading.current_thread().name, err)),
    )
    task.start()
    assert task.join(30)
    assert task.error is boom
    assert reported == [("millpond-test-error", boom)]


def test_without_on_error_the_thread_ends_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    boom = ValueError("boom")

    def body() -> None:
        raise boom

    task = BackgroundTask("millpond-test-raises", body).start()
    assert task.join(30)
    assert task.error is boom
    assert [(args.exc_value, args.thread.name) for args in hooked] == [
        (boom, "millpond-test-raises")
    ]


def test_a_join_or_a_stop_on_the_tasks_own_thread_returns_at_once() -> None:
    answers: list[bool] = []

    def body() -> None:
        answers.append(task.join())
        answers.append(task.stop())

    task = BackgroundTask("millpond-test-self", body)
    task.start()
    assert task.join(30)
    assert answers == [False, False]
    assert task.error is None


def test_a_subclass_with_names_of_its_own_keeps_the_tasks_error_handling() -> None:
    reported: list[BaseException] = []

    class Loop(BackgroundTask):
        def __init__(self) -> None:
            super().__init__("millpond-test-loop", self._run, on_error=reported.append)
            self._stop = "a name of its own"
            self._thread = "and another"

        def _run(self) -> None:
            raise KeyError(self._stop)

    loop = Loop().start()
    assert loop.join(30)
    assert isinstance(loop.error, KeyError)
    assert reported == [loop.error]
