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
from collections.abc import Iterator, Mapping
from pathlib import Path
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
    jvm_output: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
) -> SparkSession:
    """Start (or return the running) Spark session, bound to 127.0.0.1, with millpond registered.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` and ``PYSPARK_PYTHON`` to this interpreter unless they are
    already set: Spark's Python workers are separate processes, and they find ``millpond`` only
    when they run an interpreter that has it installed. Stop the session with ``spark.stop()``
    when done.

    Args:
        master: the Spark master URL; default ``local[2]``.
        app_name: the application name.
        conf: extra Spark settings, applied after :data:`LOCAL_SPARK_CONF`.
        log_level: the JVM log level (``ERROR`` keeps the console readable); applied through
            a log4j2 configuration file unless ``conf`` sets ``spark.driver.extraJavaOptions``.
        jvm_output: a file that takes everything the JVM (and the Python workers it starts)
            writes to stdout and stderr, start-up lines included, instead of this process's
            console; only when this call starts the JVM.
        work_dir: a directory for Spark's scratch files (``spark.local.dir``) and the JVM's
            temporary files (``java.io.tmpdir``), so that removing it removes them all;
            default Spark's (the system's temporary directory).

    Returns:
        The session, with the ``millpond`` data source registered.
    """
    from pyspark.sql import SparkSession

    from millpond.producer.spark.datasource import register

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings = _settings(log_level, work_dir, conf)
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    with _output_to(jvm_output):
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    register(spark)
    logger.info("spark session %s on %s", app_name, master)
    return spark


def _settings(
    log_level: str, work_dir: str | os.PathLike[str] | None, conf: Mapping[str, str] | None
) -> dict[str, str]:
    """The session's Spark settings: :data:`LOCAL_SPARK_CONF`, the scratch directories under
    ``work_dir`` (made here), the driver JVM's options, then ``conf``."""
    java_options = f"-Dlog4j2.configurationFile={_log4j_config(log_level)}"
    scratch: dict[str, str] = {}
    if work_dir is not None:
        local, tmp = Path(work_dir) / "spark-local", Path(work_dir) / "jvm-tmp"
        local.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        scratch["spark.local.dir"] = str(local)
        java_options += f" -Djava.io.tmpdir={tmp}"
    return {
        **LOCAL_SPARK_CONF,
        **scratch,
        # Without a log4j configuration of its own the JVM logs its start-up warnings before
        # any log level can be set; the driver JVM reads this one when it starts.
        "spark.driver.extraJavaOptions": java_options,
        **(conf or {}),
    }


_LOG4J = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
"""


@contextlib.contextmanager
def _output_to(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """While the block runs, file descriptors 1 and 2 point at ``path``: a child started in it
    (the JVM) keeps writing there for its whole life; this process gets its own back after."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


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
