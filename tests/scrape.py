"""Reading Prometheus exposition text the way a scraper does, for the metrics tests."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from millpond.common.exposition import CATALOG, MetricKind


def parse(body: str) -> dict[str, Any]:
    """Exposition text as ``{series: value}``: ``name`` or ``name{k="v",...}`` (labels
    sorted), histograms as their ``_count``, ``_sum`` and ``_bucket`` series; ``"#types"``
    maps each family to its type."""
    values: dict[str, Any] = {"#types": {}}
    for family in text_string_to_metric_families(body):
        values["#types"][family.name] = family.type
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def scrape(url: str) -> dict[str, Any]:
    """GET ``url`` (a ``/metrics`` endpoint) and :func:`parse` it."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def family(name: str) -> str:
    """The family name the parser reports for a catalog name (counters lose ``_total``)."""
    return name.removesuffix("_total") if CATALOG[name].kind is MetricKind.COUNTER else name


def served_url(stderr: Callable[[], str], timeout: float = 60) -> str:
    """The URL a ``millpond`` command printed when it started serving metrics."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(r"serving metrics on (http://\S+/metrics)", stderr())
        if match:
            return match.group(1)
        if time.monotonic() > deadline:
            raise AssertionError(f"no metrics URL printed within {timeout} s: {stderr()!r}")
        time.sleep(0.05)
