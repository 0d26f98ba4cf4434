"""What every benchmark shares: the result shape, plot specs, local servers, timing helpers.

A benchmark module ``bench/bench_<name>.py`` exposes ``run(quick: bool) -> dict`` and builds its
return value with :func:`make_result`::

    {
        "name": "manifest_appends",        # the module name without "bench_"
        "ratio": 0.97,                     # measured / baseline (the figure the target judges)
        "target": 0.9,
        "target_op": ">=",                 # ">=" (higher is better) or "<=" (lower is better)
        "figures": {...},                  # what was measured (JSON values)
        "baseline": {...},                 # the baseline measured in the same run
        "series": [PlotSpec, ...],         # optional: plotted to bench/results/<name>.png
        "headline": "...",                 # optional: one line for the summary table
        "notes": "...",                    # optional: how to read the figures
    }

A plot spec is ``{"title", "x_label", "y_label", "x": [...], "lines": {label: [...]},
"log_x": bool, "log_y": bool, "hline": {"label", "y"}}`` (``log_*`` and ``hline`` optional).
The harness adds ``passed``, ``seconds``, ``quick`` and machine details.

Injected store latency. ``python -m bench --latency-ms 50`` sets ``MILLPOND_BENCH_LATENCY_MS``
for each benchmark's process; :func:`seaweedfs_endpoint` then hands out the endpoint of a
latency proxy (``millpond.localstack.latency_proxy``, run as a child process so the benchmark's
own threads never hold up its event loop) in front of SeaweedFS, so every request of the
measured run *and* of its baseline pays the same delay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "LATENCY_ENV",
    "latency_ms",
    "latency_proxy",
    "make_result",
    "passed",
    "plot_spec",
    "report_to",
    "seaweedfs_endpoint",
    "seaweedfs_endpoints",
    "stopwatch",
]

logger = logging.getLogger(__name__)

TARGET_OPS = (">=", "<=")
LATENCY_ENV = "MILLPOND_BENCH_LATENCY_MS"
"""Milliseconds of injected latency per store request (``python -m bench --latency-ms``)."""


def stop_child(child: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """Stop a child this benchmark started: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    child.terminate()
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def report_to(out: Any, fn: Callable[..., Any], *args: Any) -> None:
    """A worker process's target: put ``fn(*args)`` on the queue ``out``, or, when it raises,
    ``{"error": ...}`` (so the parent fails fast instead of waiting out its timeout)."""
    try:
        out.put(fn(*args))
    except BaseException as err:
        out.put({"error": f"{type(err).__name__}: {err}"})
        raise


def latency_ms(default: float = 0.0) -> float:
    """The injected store latency for this run, in milliseconds (``default`` when unset)."""
    value = os.environ.get(LATENCY_ENV, "")
    return float(value) if value else default


def make_result(
    name: str,
    *,
    ratio: float,
    target: float,
    figures: Mapping[str, Any],
    baseline: Mapping[str, Any],
    target_op: str = ">=",
    series: Sequence[Mapping[str, Any]] = (),
    headline: str = "",
    notes: str = "",
    side_rows: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The dict a benchmark's ``run()`` returns.

    ``side_rows``: further targets the same run judges (``name`` suffix, ``ratio``,
    ``target``, ``target_op``, ``headline``); each becomes a row of its own in the summary
    table and plot, named ``<name>/<suffix>``.

    Raises:
        ValueError: an unknown ``target_op``.
    """
    if target_op not in TARGET_OPS:
        raise ValueError(f"target_op: expected one of {TARGET_OPS}, found {target_op!r}")
    result: dict[str, Any] = {
        "name": name,
        "ratio": round(float(ratio), 4),
        "target": float(target),
        "target_op": target_op,
        "figures": dict(figures),
        "baseline": dict(baseline),
    }
    if series:
        result["series"] = [dict(s) for s in series]
    if headline:
        result["headline"] = headline
    if notes:
        result["notes"] = notes
    if side_rows:
        result["side_rows"] = [dict(row) for row in side_rows]
    return result


def passed(result: Mapping[str, Any]) -> bool | None:
    """Whether ``ratio`` meets ``target``; ``None`` when the result has no usable ratio."""
    ratio, target = result.get("ratio"), result.get("target")
    if not isinstance(ratio, (int, float)) or not isinstance(target, (int, float)):
        return None
    if result.get("target_op", ">=") == "<=":
        return float(ratio) <= float(target)
    return float(ratio) >= float(target)


def plot_spec(
    title: str,
    x_label: str,
    y_label: str,
    x: Sequence[float],
    lines: Mapping[str, Sequence[float]],
    *,
    log_x: bool = False,
    log_y: bool = False,
    hline: tuple[str, float] | None = None,
) -> dict[str, Any]:
    """One panel of a benchmark's plot (see the module docstring)."""
    spec: dict[str, Any] = {
        "title": title,
        "x_label": x_label,
        "y_label": y_label,
        "x": list(x),
        "lines": {label: list(values) for label, values in lines.items()},
        "log_x": log_x,
        "log_y": log_y,
    }
    if hline is not None:
        spec["hline"] = {"label": hline[0], "y": hline[1]}
    return spec


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoints:
    """The S3 server twice: ``direct`` (to build state fast) and ``measured`` (through the
    latency proxy when one runs, else the same as ``direct``)."""

    direct: Any
    measured: Any
    latency_ms: float


@contextlib.contextmanager
def latency_proxy(endpoint: Any, delay_ms: float) -> Iterator[Any]:
    """A latency proxy child process in front of ``endpoint``; yields the proxied endpoint.

    Raises:
        RuntimeError: the proxy did not start.
    """
    command = [
        sys.executable, "-m", "millpond.localstack.latency_proxy",
        "--upstream", endpoint.endpoint, "--delay-ms", str(delay_ms),
    ]  # fmt: skip
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        first = child.stdout.readline().split()
        if len(first) < 2 or not first[1].startswith("http://127.0.0.1:"):
            raise RuntimeError(f"latency proxy did not start (exit code {child.poll()})")
        logger.info("latency proxy %s -> %s, %s ms", first[1], endpoint.endpoint, delay_ms)
        yield dataclasses.replace(endpoint, endpoint=first[1])
    finally:
        stop_child(child, 15)


@contextlib.contextmanager
def seaweedfs_endpoints(delay_ms: float | None = None) -> Iterator[Endpoints]:
    """A SeaweedFS S3 server on 127.0.0.1, directly and behind a latency proxy.

    Args:
        delay_ms: injected latency per request; ``None`` takes :func:`latency_ms`; 0 means
            no proxy.

    ``MILLPOND_BENCH_S3_ENDPOINT`` (with the ``MILLPOND_TEST_S3_*`` credential variables) points
    the benchmarks at an external server instead.
    """
    from millpond.localstack import external_s3_from_env, start_seaweedfs

    delay = latency_ms() if delay_ms is None else delay_ms
    with contextlib.ExitStack() as stack:
        external_url = os.environ.get("MILLPOND_BENCH_S3_ENDPOINT")
        if external_url:
            direct = external_s3_from_env({**os.environ, "MILLPOND_TEST_S3_ENDPOINT": external_url})
        else:
            started = time.monotonic()
            server = stack.enter_context(start_seaweedfs())
            direct = server.endpoint
            logger.info("SeaweedFS up in %.1f s at %s", time.monotonic() - started, direct.endpoint)
        measured = direct
        if delay > 0:
            measured = stack.enter_context(latency_proxy(direct, delay))
        yield Endpoints(direct, measured, delay)


@contextlib.contextmanager
def seaweedfs_endpoint() -> Iterator[Any]:
    """A SeaweedFS S3 server on 127.0.0.1 for the duration of the block; yields its endpoint.

    Behind a latency proxy when the run injects latency (``--latency-ms``).
    ``MILLPOND_BENCH_S3_ENDPOINT`` (with the ``MILLPOND_TEST_S3_*`` credential variables) points
    the benchmarks at an external server instead.
    """
    with seaweedfs_endpoints() as endpoints:
        yield endpoints.measured


class stopwatch:
    """Monotonic elapsed seconds of a ``with`` block, in ``.seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
