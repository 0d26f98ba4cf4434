"""A class-data-sharing archive of Spark's classes for the JVMs the Spark tests start.

A Spark driver spends most of its start-up loading and verifying classes: about 13 s on this
machine, 7 s when the classes come mapped from an archive (``-XX:SharedArchiveFile``, JDK 13+).
The Spark suite starts a driver JVM a dozen times (its own session per worker, then the
streaming, demo, python-worker and speculation jobs as processes of their own), so the archive
is made once per machine and Spark version, in a process of its own, and every JVM started
after it is in place maps it. ``make test`` makes it before the suite starts
(``python -m tests.spark.class_archive``: about 50 s, once), so that even the first drivers
map it and its making does not compete with the tests; a suite started without it makes it in
the background. It changes how fast classes load, nothing else: a JVM that finds
no usable archive loads them as before, and says nothing (``-Xlog:cds=off``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

SPARK_TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""JVM options for every Spark driver the suite starts (in-process and in the job processes
it runs, which inherit the environment): the tests' Spark jobs are short, so the JVM's
optimising compiler and parallel collector only compete with the other test worker for the
two cores. Measured on ``tests/spark`` with two workers: 392 s of test time without, 298 s
with. Nothing a test asserts depends on how the JVM compiles; the benchmarks, the demo and
users' sessions keep the JVM's defaults."""

# Loads the classes a small job uses, stops, waits for the JVM to write the archive as it exits
# (closing its stdin is what ends PySpark's gateway JVM), then puts it in place under its name.
_MAKE = """
import os, sys
from millpond.producer.spark import local_spark_session
partial, final = sys.argv[1:3]
spark = local_spark_session("local[2]", app_name="millpond-class-archive")
proc = spark.sparkContext._gateway.proc
spark.range(1000).selectExpr("id", "cast(id as string) AS s").toArrow()
spark.stop()
proc.stdin.close()
proc.wait(timeout=120)
if proc.returncode == 0 and os.path.isfile(partial) and os.path.getsize(partial) > 0:
    os.replace(partial, final)
elif os.path.isfile(partial):
    os.remove(partial)  # half an archive: the JVM did not end as it should
"""

_QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def _archive_path() -> Path:
    """Where the archive for this Java and this Spark lives (one per pair)."""
    import pyspark

    java = subprocess.run(
        ["java", "-version"], capture_output=True, text=True, check=False, timeout=60
    ).stderr
    key = hashlib.sha256(f"{java}\0{pyspark.__file__}\0{pyspark.__version__}".encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "millpond-tests"
    return cache / f"spark-classes-{key[:16]}.jsa"


@contextmanager
def spark_java_options() -> Iterator[str]:
    """Java options that map the archive; ``""`` without a ``java`` to make one with.

    When this machine has no archive yet, one is made in the background while the tests run
    (by whichever test worker takes the lock first), and JVMs started from then on map it: a
    JVM started before it is in place finds no file and loads its classes as always. On exit
    this waits for the archive being made, so no process outlives the session.
    """
    if shutil.which("java") is None:
        yield ""
        return
    path = _archive_path()
    maker: subprocess.Popen[bytes] | None = None
    if not path.is_file():
        maker = _start_maker(path)
    try:
        yield f"-XX:SharedArchiveFile={path} {_QUIET}"
    finally:
        if maker is not None:
            try:
                maker.wait(timeout=300)
            except subprocess.TimeoutExpired:
                logger.warning("the Spark class archive maker (pid %s) took too long", maker.pid)
                maker.kill()
                maker.wait()


def _start_maker(path: Path) -> subprocess.Popen[bytes] | None:
    """Start making the archive unless another process is at it (it holds the lock)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_suffix(".lock").open("w")
    except OSError as err:  # no cache to write to: the JVMs start as always
        logger.warning("no Spark class archive at %s: %s", path, err)
        return None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # another worker is making it
        if path.is_file():
            return None
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        # The JVM options the tests' drivers have: the archive is their classes, and the
        # optimising compiler only made the dump cost a third more CPU.
        options = f"{SPARK_TEST_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial} {_QUIET}"
        env = {**os.environ, "SPARK_SUBMIT_OPTS": options}
        # The maker inherits the lock, and holds it until it exits.
        return subprocess.Popen(
            [sys.executable, "-c", _MAKE, str(partial), str(path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(lock.fileno(),),
        )
    finally:
        lock.close()


def main() -> int:
    """Make the archive now unless it is in place (or another process is making it)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if shutil.which("java") is None:
        return 0
    path = _archive_path()
    if path.is_file():
        return 0
    logger.info("making the Spark class archive for the tests' JVMs (once): %s", path)
    maker = _start_maker(path)
    if maker is not None and maker.wait(timeout=300) != 0:
        logger.warning("the Spark class archive maker failed (status %s)", maker.returncode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
