"""Where the figures go: the ``QueueStat`` table and, optionally, Parquet.

Re-running a window replaces its figures: the table's rows for the window's
hours are deleted and the new ones inserted in one transaction, and the
Parquet output is partitioned by hour and overwritten per partition.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from django.db import transaction

from ...models import QueueStat
from .source import Window

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PARQUET_SCHEMA = (
    "hour_utc STRING, hour TIMESTAMP, queue STRING, kind STRING, enqueued BIGINT, acked BIGINT, dead BIGINT, "
    "expired BIGINT, retried BIGINT, wait_p50 DOUBLE, wait_p95 DOUBLE, wait_p99 DOUBLE, processing_p50 DOUBLE, "
    "processing_p95 DOUBLE, processing_p99 DOUBLE, attempts MAP<STRING, BIGINT>, "
    "top_errors ARRAY<STRUCT<error_type: STRING, count: BIGINT>>, throughput DOUBLE"
)


def write_table(stats: list[dict[str, Any]], window: Window, using: str) -> int:
    """Replace the window's ``QueueStat`` rows with ``stats``; returns the rows written."""
    with transaction.atomic(using=using):
        QueueStat.objects.using(using).filter(window.q("hour")).delete()
        QueueStat.objects.using(using).bulk_create([QueueStat(**stat) for stat in stats], batch_size=500)
    return len(stats)


def write_parquet(spark: SparkSession, stats: list[dict[str, Any]], directory: str | os.PathLike[str]) -> None:
    """Write ``stats`` under ``directory``, one partition per hour (``hour_utc=YYYY-MM-DDTHH``)."""
    rows = [
        {
            **stat,
            "hour_utc": stat["hour"].strftime("%Y-%m-%dT%H"),
            "top_errors": [{"error_type": name, "count": count} for name, count in stat["top_errors"]],
        }
        for stat in stats
    ]
    frame = spark.createDataFrame(rows, PARQUET_SCHEMA)
    frame.write.mode("overwrite").partitionBy("hour_utc").parquet(os.fspath(directory))
