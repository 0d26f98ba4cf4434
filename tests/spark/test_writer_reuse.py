"""What the ``millpond`` data source does again for every micro-batch, and what it keeps
(issue 49): Spark makes the stream writer twice a micro-batch, in processes that live on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pyspark.sql.types import LongType, StructField, StructType

from millpond.producer.spark import datasource
from millpond.producer.spark.datasource import MillpondDataSource
from millpond.producer.spark.options import SparkWriteSettings

SCHEMA = StructType([StructField("id", LongType())])


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every probe of the store the data source sends (by the store URL)."""
    sent: list[str] = []
    real = SparkWriteSettings.probe

    def probe(self: SparkWriteSettings) -> SparkWriteSettings:
        sent.append(self.store_url)
        return real(self)

    monkeypatch.setattr(SparkWriteSettings, "probe", probe)
    monkeypatch.setattr(datasource, "_probed", {})
    return sent


def _options(tmp_path: Path, name: str = "q") -> dict[str, str]:
    return {"store": f"file://{tmp_path / name}", "checkpointLocation": str(tmp_path / "ckpt")}


def test_a_stream_probes_the_store_once_a_minute_not_every_micro_batch(
    tmp_path: Path, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(datasource.time, "monotonic", lambda: now[0])
    source = MillpondDataSource(_options(tmp_path))
    for _ in range(4):  # two micro-batches: each planned and committed
        source.streamWriter(SCHEMA, False)
        now[0] += 5
    assert probes == [f"file://{tmp_path / 'q'}"]
    now[0] += datasource.STREAM_PROBE_INTERVAL
    source.streamWriter(SCHEMA, False)
    assert len(probes) == 2, "a minute on, the store is checked again"
    MillpondDataSource(_options(tmp_path, "other")).streamWriter(SCHEMA, False)
    assert len(probes) == 3, "another queue is checked on its own"


def test_a_batch_job_still_probes_the_store_every_time(tmp_path: Path, probes: list[str]) -> None:
    source = MillpondDataSource(_options(tmp_path))
    source.writer(SCHEMA, False)
    source.writer(SCHEMA, False)
    assert len(probes) == 2


def test_a_probed_grace_period_stands_for_the_micro_batches_that_reuse_it(
    tmp_path: Path, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = SparkWriteSettings.probe  # the fixture's: counts, then probes

    def shorter(self: SparkWriteSettings) -> SparkWriteSettings:
        # The queue's claim says its collectors keep uploads 120 s.
        return dataclasses.replace(counted(self), gc_grace_period=120.0)

    monkeypatch.setattr(SparkWriteSettings, "probe", shorter)
    source = MillpondDataSource(_options(tmp_path))
    first = source.streamWriter(SCHEMA, False)
    again = source.streamWriter(SCHEMA, False)
    assert len(probes) == 1
    assert first.settings.gc_grace_period == again.settings.gc_grace_period == 120.0


def test_settings_of_one_store_share_one_client_per_process(tmp_path: Path) -> None:
    one = SparkWriteSettings.from_options({"store": f"file://{tmp_path / 'q'}"})
    same = SparkWriteSettings.from_options({"store": f"file://{tmp_path / 'q'}"})
    other = SparkWriteSettings.from_options({"store": f"file://{tmp_path / 'r'}"})
    assert one.open_store() is same.open_store()
    assert one.open_store() is not other.open_store()
