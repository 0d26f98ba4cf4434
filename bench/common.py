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
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "make_result",
    "passed",
    "plot_spec",
    "seaweedfs_endpoint",
    "stopwatch",
]

logger = logging.getLogger(__name__)

TARGET_OPS = (">=", "<=")


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
) -> dict[str, Any]:
    """The dict a benchmark's ``run()`` returns.

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


@contextlib.contextmanager
def seaweedfs_endpoint() -> Iterator[Any]:
    """A SeaweedFS S3 server on 127.0.0.1 for the duration of the block; yields its endpoint.

    ``MILLPOND_BENCH_S3_ENDPOINT`` (with the ``MILLPOND_TEST_S3_*`` credential variables) points
    the benchmarks at an external server instead.
    """
    from millpond.localstack import external_s3_from_env, start_seaweedfs

    external_url = os.environ.get("MILLPOND_BENCH_S3_ENDPOINT")
    if external_url:
        endpoint = external_s3_from_env({**os.environ, "MILLPOND_TEST_S3_ENDPOINT": external_url})
        yield endpoint
        return
    started = time.monotonic()
    server = start_seaweedfs()
    logger.info(
        "SeaweedFS up in %.1f s at %s", time.monotonic() - started, server.endpoint.endpoint
    )
    try:
        yield server.endpoint
    finally:
        server.close()


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
