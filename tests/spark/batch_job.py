"""A batch job writing to millpond, run as its own process, so that it starts with the
environment a test gives it (Spark's JVM, and the Python workers it starts for the driver's
commit, take theirs from the process that started them).

``python batch_job.py ROWS OPTIONS_JSON`` writes ids 0..ROWS-1 (one column ``id``) with those
data source options and prints ``done``.
"""

from __future__ import annotations

import json
import sys

from millpond.producer.spark import local_spark_session


def main() -> None:
    rows, options_json = int(sys.argv[1]), sys.argv[2]
    spark = local_spark_session("local[2]", app_name="millpond-batch-job")
    try:
        spark.range(rows).write.format("millpond").options(**json.loads(options_json)).mode(
            "append"
        ).save()
        print("done", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
