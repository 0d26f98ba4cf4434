"""The Spark driver's one line per job or micro-batch: batches, bytes, rows, CAS conflicts.

Spark runs a Python data source's ``commit()`` in a Python worker it starts itself, where no
one configured logging: the line would go nowhere. :func:`ensure_summary_output` gives the
summary logger (``millpond.producer.spark.summary``, INFO) a stderr handler there — only when
the worker's root logger has no handler of its own, so an application (or Spark's own worker
log capture) that configured logging gets the record through its handlers instead, once. The
worker's stderr is the driver's: the line shows in the driver's console or log.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence

from millpond.producer.spark.upload import UploadStats

__all__ = ["SUMMARY_LOGGER", "ensure_summary_output", "log_summary"]

SUMMARY_LOGGER = "millpond.producer.spark.summary"

logger = logging.getLogger(SUMMARY_LOGGER)


def ensure_summary_output() -> None:
    """Make the summary line visible in a Spark Python worker (see the module docstring)."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def log_summary(
    what: str,
    *,
    stats: UploadStats,
    status: str,
    sequences: Sequence[int],
    manifest: Mapping[str, int],
) -> None:
    """Log the summary line of one commit.

    Args:
        what: ``job <id>`` or ``stream <id> batch <n>``.
        stats: what the winning task attempts uploaded.
        status: how the commit resolved (``appended``, ``skipped``, ...).
        sequences: where the entries went (empty when nothing was enqueued).
        manifest: the commit's manifest counters (``manifest_writes``, ``cas_conflicts``).
    """
    where = f" at sequences {sequences[0]}..{sequences[-1]}" if sequences else ""
    line = (
        f"millpond {what}: {stats.batches} batches, {stats.bytes} bytes, {stats.rows} rows "
        f"{status}{where} ({manifest.get('cas_conflicts', 0)} CAS conflicts, "
        f"{manifest.get('manifest_writes', 0)} manifest writes)"
    )
    logger.info("%s", line)
