"""A local Spark session that binds loopback only and can write to millpond.

The demo, the tests and the benchmark all start Spark through :func:`local_spark_session`, so
they share one set of decisions: the driver binds ``127.0.0.1``, the web UI is off, the Python
workers run the interpreter that runs the caller (so they can import ``millpond``), and the
``millpond`` data source is registered.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["LOCAL_SPARK_CONF", "local_spark_session"]

logger = logging.getLogger(__name__)

LOCAL_SPARK_CONF: Mapping[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Small jobs on two cores: the default of 200 shuffle partitions is pure overhead here.
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
}
"""Spark settings :func:`local_spark_session` applies before the caller's own."""


def local_spark_session(
    master: str = "local[2]",
    *,
    app_name: str = "millpond",
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
) -> SparkSession:
    """Start (or return the running) Spark session, bound to 127.0.0.1, with millpond registered.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` and ``PYSPARK_PYTHON`` to this interpreter unless they are
    already set. Stop the session with ``spark.stop()`` when done.

    Args:
        master: the Spark master URL; default ``local[2]``.
        app_name: the application name.
        conf: extra Spark settings, applied after :data:`LOCAL_SPARK_CONF`.
        log_level: the JVM log level (``ERROR`` keeps the console readable); applied through
            a log4j2 configuration file unless ``conf`` sets ``spark.driver.extraJavaOptions``.

    Returns:
        The session, with the ``millpond`` data source registered.
    """
    from pyspark.sql import SparkSession

    from millpond.producer.spark import register

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings = {
        **LOCAL_SPARK_CONF,
        # Without a log4j configuration of its own the JVM logs its start-up warnings before
        # any log level can be set; the driver JVM reads this one when it starts.
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={_log4j_config(log_level)}",
        **(conf or {}),
    }
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    register(spark)
    logger.info("spark session %s on %s", app_name, master)
    return spark


_LOG4J = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
"""


def _log4j_config(level: str) -> str:
    """A log4j2 configuration file at ``level``, removed when this process exits."""
    handle, path = tempfile.mkstemp(prefix="millpond-log4j2-", suffix=".properties")
    with os.fdopen(handle, "w") as out:
        out.write(_LOG4J.format(level=level.lower()))
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
