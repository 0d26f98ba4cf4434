"""ProducerConfig: RFC defaults, validation naming the bad key, and string options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from millpond import CompressionType, ConfigError
from millpond.common.retry import RetryPolicy
from millpond.producer import ProducerConfig
from millpond.producer.config import parse_duration, parse_size


def _config(tmp_path: Path, **kw: object) -> ProducerConfig:
    kw.setdefault("store", "memory://")
    return ProducerConfig(wal_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_defaults_follow_the_rfc(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.data_path_prefix == "ingest"
    assert config.manifest_path == "ingest/manifest"
    assert config.flush_interval == 0.1
    assert config.flush_size_bytes == 64 << 20
    assert config.max_buffered_inputs == 1000
    assert config.batch_compression is CompressionType.NONE
    assert config.wal_sync == "always"
    assert config.wal_max_bytes == 4 << 30
    assert config.wal_rotate_bytes == 64 << 20
    assert config.size_cap_policy == "backpressure"


def test_wal_dir_is_required() -> None:
    with pytest.raises(TypeError, match="wal_dir"):
        ProducerConfig(store="memory://")  # type: ignore[call-arg]


def test_compression_accepts_names(tmp_path: Path) -> None:
    assert _config(tmp_path, batch_compression="zstd").batch_compression is CompressionType.ZSTD
    assert _config(tmp_path, batch_compression="ZSTD").compression is CompressionType.ZSTD


def test_rotation_default_scales_with_a_small_cap(tmp_path: Path) -> None:
    config = _config(tmp_path, wal_max_bytes=1 << 20)
    assert config.wal_rotate_bytes == 128 << 10


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("store", "ftp://x", "URL"),
        ("store", 42, "found int"),
        ("data_path_prefix", "../up", "relative"),
        ("manifest_path", "", "non-empty"),
        ("flush_interval", 0, "> 0"),
        ("flush_interval", float("nan"), "> 0"),
        ("flush_size_bytes", 0, ">= 1"),
        ("flush_size_bytes", 1.5, "int"),
        ("max_buffered_inputs", 0, ">= 1"),
        ("max_buffered_inputs", True, "int"),
        ("batch_compression", "lz4", "'none' or 'zstd'"),
        ("wal_sync", "sometimes", "'always' or 'interval' or 'off'"),
        ("wal_sync_interval", -1, "> 0"),
        ("wal_max_bytes", 10, ">= 65536"),
        ("wal_rotate_bytes", 2 << 30, "wal_max_bytes // 4"),
        ("size_cap_policy", "drop_newest", "'backpressure' or 'drop_oldest'"),
        ("upload_concurrency", 0, ">= 1"),
        ("retry", {"max_attempts": 3}, "RetryPolicy"),
        ("reupload_after", 0, "> 0"),
        ("store_options", {"k": 1}, "str to str"),
        ("clock", object(), "Clock"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        _config(tmp_path, **{key: value})
    assert info.value.key == key


def test_from_options_parses_strings(tmp_path: Path) -> None:
    config = ProducerConfig.from_options(
        {
            "store": "memory://",
            "wal_dir": str(tmp_path),
            "flush_interval": "250ms",
            "flush_size_bytes": "8MiB",
            "max_buffered_inputs": "10",
            "batch_compression": "zstd",
            "wal_sync": "interval",
            "wal_sync_interval": "0.5",
            "wal_max_bytes": "1g",
            "wal_rotate_bytes": "16m",
            "size_cap_policy": "drop_oldest",
            "upload_concurrency": "2",
            "reupload_after": "2m",
            "store_options.aws_region": "eu-west-1",
            "retry.max_attempts": "7",
            "retry.max_elapsed": "3s",
        }
    )
    assert config.flush_interval == 0.25
    assert config.flush_size_bytes == 8 << 20
    assert config.max_buffered_inputs == 10
    assert config.batch_compression is CompressionType.ZSTD
    assert config.wal_sync == "interval"
    assert config.wal_max_bytes == 1 << 30
    assert config.wal_rotate_bytes == 16 << 20
    assert config.size_cap_policy == "drop_oldest"
    assert config.reupload_after == 120.0
    assert dict(config.store_options) == {"aws_region": "eu-west-1"}
    assert config.retry.max_attempts == 7
    assert config.retry.max_elapsed == 3.0


@pytest.mark.parametrize(
    ("options", "key", "expected"),
    [
        ({"flush_intervall": "1"}, "flush_intervall", "unknown option"),
        ({"flush_interval": "soon"}, "flush_interval", "duration"),
        ({"flush_size_bytes": "64 parsecs"}, "flush_size_bytes", "size"),
        ({"max_buffered_inputs": "many"}, "max_buffered_inputs", "integer"),
        ({"retry.forever": "1"}, "retry.forever", "retry."),
        ({"retry.max_attempts": "0"}, "retry.max_attempts", ">= 1"),
        ({"retry.strategy": "fifo"}, "retry.strategy", "exponential, aging"),
        ({"wal_sync": "never"}, "wal_sync", "'always'"),
    ],
)
def test_from_options_names_the_bad_key(
    tmp_path: Path, options: dict[str, str], key: str, expected: str
) -> None:
    full = {"store": "memory://", "wal_dir": str(tmp_path), **options}
    with pytest.raises(ConfigError, match=expected) as info:
        ProducerConfig.from_options(full)
    assert info.value.key == key


def test_lost_races_are_paced_by_age_unless_the_options_say_otherwise(tmp_path: Path) -> None:
    assert _config(tmp_path).retry.strategy == "aging"
    chosen = ProducerConfig.from_options(
        {"store": "memory://", "wal_dir": str(tmp_path), "retry.strategy": "exponential"}
    )
    assert chosen.retry.strategy == "exponential"
    assert chosen.retry.max_elapsed == _config(tmp_path).retry.max_elapsed  # the rest default


def test_from_options_requires_store_and_wal_dir() -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_options({"store": "memory://"})
    assert info.value.key == "wal_dir"


def test_secrets_stay_out_of_repr(tmp_path: Path) -> None:
    config = _config(tmp_path, store_options={"aws_secret_access_key": "hunter2"})
    assert "hunter2" not in repr(config)


def test_config_is_frozen(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.flush_interval = 1.0  # type: ignore[misc]
    assert isinstance(config.retry, RetryPolicy)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("64MiB", 64 << 20),
        ("64m", 64 << 20),
        ("1GB", 10**9),
        ("4 GiB", 4 << 30),
        ("512k", 512 << 10),
        ("0.5KiB", 512),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.1", 0.1), ("100ms", 0.1), ("5s", 5.0), ("2m", 120.0), ("1h", 3600.0), (".5", 0.5)],
)
def test_parse_duration(text: str, value: float) -> None:
    assert parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize(
    "url", ["s3://b/q", "s3a://b", "az://container/q", "gs://bucket/q", "file:///x", "memory://"]
)
def test_every_store_scheme_is_accepted(tmp_path: Path, url: str) -> None:
    assert _config(tmp_path, store=url).store == url


@pytest.mark.parametrize("url", ["ftp://host/x", "abfs://c", "bucket/q"])
def test_other_store_urls_are_refused_naming_the_forms(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, store=url)
    assert info.value.key == "store"
    assert "az://container[/root]" in str(info.value)
    assert "gs://bucket[/root]" in str(info.value)


def test_spark_options_pass_bare_store_keys_of_every_backend() -> None:
    from millpond.producer.spark.options import SparkWriteSettings

    settings = SparkWriteSettings.from_options(
        {
            "store": "az://container/q",
            "azure_storage_account_name": "acct",
            "azure_storage_account_key": "a2V5",
            "google_service_account": "/k.json",
            "aws_region": "eu-west-1",
            "allow_http": "true",
        }
    )
    assert settings.store_url == "az://container/q"
    assert dict(settings.store_options) == {
        "azure_storage_account_name": "acct",
        "azure_storage_account_key": "a2V5",
        "google_service_account": "/k.json",
        "aws_region": "eu-west-1",
        "allow_http": "true",
    }
    assert "a2V5" not in repr(settings)


def test_spark_host_coordinator_is_for_task_commits_only() -> None:
    from millpond.producer.spark.datasource import _settings

    base = {"store": "s3://bucket/q", "host_coordinator": "true", "check_store": "false"}
    with pytest.raises(ConfigError, match="commit=task"):
        _settings(base, overwrite=False)
    settings = _settings({**base, "commit": "task"}, overwrite=False)
    assert settings.host_coordinator
    assert settings.producer_options["host_coordinator"] == "true"
