"""A streaming query writing to millpond, run as its own process so a test can SIGKILL it.

``python stream_job.py INPUT_DIR CHECKPOINT_DIR OPTIONS_JSON`` reads the JSON files in
INPUT_DIR one per micro-batch (``maxFilesPerTrigger=1``), writes them to millpond with
``trigger(availableNow=True)``, prints ``query <id>`` when it starts and ``done`` at the end.
"""

from __future__ import annotations

import json
import sys

from millpond.producer.spark import local_spark_session


def main() -> None:
    input_dir, checkpoint, options_json = sys.argv[1:4]
    spark = local_spark_session("local[2]", app_name="millpond-stream-job")
    try:
        stream = (
            spark.readStream.schema("id BIGINT, file INT")
            .option("maxFilesPerTrigger", 1)
            .json(input_dir)
            .writeStream.format("millpond")
            .options(**json.loads(options_json))
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        print("query", stream.id, flush=True)
        stream.awaitTermination()
        print("done", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
