"""One Spark session for the whole Spark suite (``local[2,4]``, loopback only).

Spark starts a JVM and Python workers, which is slow: every Spark test shares this session.
S3 is the session's moto server (``moto_s3`` in ``tests/conftest.py``); each test writes under
its own root in the bucket, so tests never see each other's queues.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
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
