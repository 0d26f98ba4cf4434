"""One Spark session for the whole Spark suite (``local[2,4]``, loopback only).

Spark starts a JVM and Python workers, which is slow: every Spark test shares this session.
S3 is the session's moto server (``moto_s3`` in ``tests/conftest.py``); each test writes under
its own root in the bucket, so tests never see each other's queues.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.spark.class_archive import spark_java_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session", autouse=True)
def _spark_class_archive() -> Iterator[None]:
    """Every Spark JVM this session starts, in this process or another, maps the suite's class
    archive (``class_archive.py``): drivers through ``SPARK_SUBMIT_OPTS``, the standalone
    cluster's master and workers through ``SPARK_DAEMON_JAVA_OPTS``."""
    saved = {name: os.environ.get(name) for name in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS")}
    with spark_java_options() as options:
        for name, value in saved.items():
            os.environ[name] = f"{value} {options}".strip() if value else options
        yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def spark(_spark_class_archive: None) -> Iterator[SparkSession]:
    """The suite's Spark session, with the millpond data source registered.

    ``local[2,4]``: two cores, and up to 4 attempts per task (local mode ignores
    ``spark.task.maxFailures``), so a test can fail a first attempt and see Spark retry it.
    """
    from millpond.producer.spark import local_spark_session

    session = local_spark_session(
        "local[2,4]",
        app_name="millpond-tests",
        conf={"spark.sql.shuffle.partitions": "2"},
    )
    yield session
    session.stop()
