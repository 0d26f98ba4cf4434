"""Run as a script: where Spark's Python workers find ``millpond`` (see the docs' Spark
page). Prints one ``RESULT`` line per attempt."""

from __future__ import annotations

import os
import sys

from millpond.producer.spark import local_spark_session


def attempt(label: str) -> None:
    spark = local_spark_session("local[1]", app_name="millpond-python-workers")
    try:
        names = spark.sparkContext.parallelize([0], 1).map(
            lambda _: __import__("millpond").__name__
        )
        print(f"RESULT {label} {os.environ['PYSPARK_PYTHON']} {names.collect()}", flush=True)
    except Exception as err:  # the worker's error, as the driver sees it
        missing = "No module named 'millpond'" in str(err)
        print(f"RESULT {label} {os.environ['PYSPARK_PYTHON']} failed missing={missing}", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    os.environ.pop("PYSPARK_PYTHON", None)
    attempt("default")  # local_spark_session() points the workers at this interpreter
    os.environ["PYSPARK_PYTHON"] = sys.argv[1]  # an interpreter without millpond: kept as set
    attempt("other")
