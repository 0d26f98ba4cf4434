"""The docs' Spark page: Python workers find ``millpond`` through ``PYSPARK_PYTHON``, and
``local_spark_session()`` sets it to the running interpreter unless the caller set it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SPARK_PAGE = Path(__file__).resolve().parents[2] / "docs" / "user-guide" / "spark.md"


@pytest.mark.slow
def test_workers_find_millpond_through_pyspark_python(tmp_path: Path) -> None:
    bare = Path(sys.base_prefix) / "bin" / "python3"  # the interpreter under the venv
    check = subprocess.run([bare, "-c", "import millpond"], capture_output=True, check=False)
    assert check.returncode != 0, "the base interpreter has millpond: it proves nothing"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
    }
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("python_workers_job.py")), str(bare)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**env, "TMPDIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [line.split(" ", 2) for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert results == [
        ["RESULT", "default", f"{sys.executable} ['millpond']"],
        ["RESULT", "other", f"{bare} failed missing=True"],
    ], run.stdout


def test_the_docs_say_how_workers_find_the_package() -> None:
    spark_section = SPARK_PAGE.read_text().split("## Spark's Python workers", 1)[1]
    spark_section = spark_section.split("\n## ", 1)[0]
    assert "PYSPARK_PYTHON" in spark_section
    assert "local_spark_session()" in spark_section
    assert "No module named 'millpond'" in spark_section
