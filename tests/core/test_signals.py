"""SIGTERM while the main thread is inside ``Event.wait()`` must still stop the command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The signal arrives while the main thread holds the event's internal lock, as it does for a
# moment inside every ``stop.wait(delay)`` of the consume and gc loops. A handler that calls
# ``stop.set()`` itself then waits for that lock forever (the consumer service hung on
# SIGTERM once in CI).
_SCRIPT = textwrap.dedent(
    """
    import os, signal, threading
    from millpond.common.signals import stop_on_signals

    stop = threading.Event()
    with stop_on_signals(stop):
        with stop._cond:  # what Event.wait() holds between its checks
            os.kill(os.getpid(), signal.SIGTERM)
        print("stopped" if stop.wait(10) else "not stopped", flush=True)
    """
)


def test_a_signal_inside_event_wait_stops_without_deadlock() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
