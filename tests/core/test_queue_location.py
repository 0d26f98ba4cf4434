"""QueueLocation: one set of checks for where a queue lives, shared by every role's config."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest

from millpond.consumer import ConsumerConfig
from millpond.errors import ConfigError
from millpond.gc import GarbageCollectorConfig
from millpond.producer import ProducerConfig
from millpond.producer.spark.options import SparkWriteSettings
from millpond.queue.location import QueueLocation
from millpond.storage import ObjectStore


def _configs(tmp_path: Path) -> list[Any]:
    return [
        QueueLocation,
        ConsumerConfig,
        GarbageCollectorConfig,
        lambda **kw: ProducerConfig(wal_dir=tmp_path, **kw),
    ]


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        ({"store": ""}, "store", "found ''"),
        ({"store": None}, "store", "found None"),
        ({"store": 42}, "store", "found int"),
        ({"store": "ftp://host/x"}, "store", "s3://bucket"),
        ({"store": "s3://b/q?x"}, "store", "no '?'"),
        ({"store_options": {"k": 1}}, "store_options", "str to str"),
        ({"store_options": ["k=v"]}, "store_options", "str to str"),
        ({"manifest_path": ""}, "manifest_path", "non-empty"),
        ({"manifest_path": "/"}, "manifest_path", "non-empty"),
        ({"manifest_path": "ingest/"}, "manifest_path", "folder"),
        ({"manifest_path": "a/../m"}, "manifest_path", "relative"),
        ({"manifest_path": 3}, "manifest_path", "found int"),
        ({"data_path_prefix": "../up"}, "data_path_prefix", "relative"),
        ({"data_path_prefix": "a//b"}, "data_path_prefix", "relative"),
        ({"data_path_prefix": "x" * 70_000}, "data_path_prefix", "at most 65495 bytes"),
        ({"data_path_prefix": None}, "data_path_prefix", "found NoneType"),
    ],
)
def test_every_config_refuses_a_bad_location_naming_the_key(
    tmp_path: Path, overrides: dict[str, Any], key: str, expected: str
) -> None:
    for config in _configs(tmp_path):
        with pytest.raises(ConfigError, match=expected) as info:
            config(**{"store": "memory://", **overrides})
        assert info.value.key == key


def test_defaults_and_what_is_accepted(tmp_path: Path) -> None:
    for config in _configs(tmp_path):
        location = config(store="memory://", store_options=None)
        assert isinstance(location, QueueLocation)
        assert location.manifest_path == "ingest/manifest"
        assert location.data_path_prefix == "ingest"
        assert dict(location.store_options) == {}
        assert config(store="memory://", data_path_prefix="").data_path_prefix == ""
        assert config(store="memory://", manifest_path="/q/m").manifest_path == "/q/m"
        assert isinstance(config(store="memory://").open_store(), ObjectStore)


def test_secrets_stay_out_of_every_repr(tmp_path: Path) -> None:
    for config in _configs(tmp_path):
        location = config(store="memory://", store_options={"aws_secret_access_key": "hunter2"})
        assert "hunter2" not in repr(location)


def test_a_location_is_frozen_and_keyword_only() -> None:
    location = QueueLocation(store="memory://")
    with pytest.raises(dataclasses.FrozenInstanceError):
        location.manifest_path = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        QueueLocation("memory://")  # type: ignore[misc]


def test_spark_settings_carry_the_location_and_pickle() -> None:
    settings = SparkWriteSettings.from_options(
        {"path": "s3://bucket/q", "manifest_path": "q/manifest", "aws_region": "eu-west-1"}
    )
    assert settings.store == settings.store_url == "s3://bucket/q"
    assert settings.manifest_path == "q/manifest"
    assert dict(settings.store_options) == {"aws_region": "eu-west-1"}
    assert pickle.loads(pickle.dumps(settings)) == settings
