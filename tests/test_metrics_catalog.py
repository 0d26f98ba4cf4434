"""The metric names: Prometheus' conventions, one catalog, and the docs naming no other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from millpond.common.exposition import CATALOG, MetricKind, MetricsCollector
from millpond.consumer.app._metrics import CONSUMER_METRICS
from millpond.errors import ConfigError
from millpond.gc.command import GC_METRICS
from millpond.producer._metrics import PRODUCER_METRICS

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
_UNITS = ("_seconds", "_bytes", "_total", "_length", "_sequence", "_epoch", "_batches")


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_names_follow_prometheus_conventions(name: str) -> None:
    spec = CATALOG[name]
    assert re.fullmatch(r"millpond_[a-z]+(_[a-z]+)*", name)
    if spec.kind is MetricKind.COUNTER:
        assert name.endswith("_total")
    else:
        assert not name.endswith("_total")
    if spec.kind is MetricKind.HISTOGRAM:
        assert name.endswith("_seconds")  # every histogram is a duration
    assert name.endswith(_UNITS), "the unit (or what is counted) ends the name"
    assert spec.help.endswith(".")


def test_every_exported_name_is_in_the_catalog_and_every_catalog_name_is_exported() -> None:
    exported = {*CONSUMER_METRICS, *GC_METRICS, *PRODUCER_METRICS}
    assert exported == set(CATALOG)
    for names, process in (
        (CONSUMER_METRICS, "consume"),
        (GC_METRICS, "gc"),
        (PRODUCER_METRICS, "producer"),
    ):
        for name in names:
            assert process in CATALOG[name].exported_by, name


def test_a_collector_refuses_names_outside_the_catalog() -> None:
    with pytest.raises(ConfigError, match="millpond_made_up_total"):
        MetricsCollector(list, ["millpond_queue_length", "millpond_made_up_total"])


def test_the_docs_list_every_metric_and_name_no_other() -> None:
    """The metrics page's table is generated from CATALOG when the site is built; every
    metric-like name the README or any page mentions is one the catalog has."""
    assert "\n<!-- millpond:metrics -->\n" in (DOCS / "operator-guide" / "metrics.md").read_text()
    text = README.read_text() + "".join(page.read_text() for page in DOCS.rglob("*.md"))
    mentioned = set(re.findall(r"millpond_[a-z_]+(?<!_)", text))
    metric_like = {m for m in mentioned if m.endswith(("_total", "_seconds", "_bytes", "_length"))}
    assert metric_like <= set(CATALOG), metric_like - set(CATALOG)
