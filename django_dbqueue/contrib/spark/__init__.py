"""Queue analytics on Spark: hourly figures from the archive, and bulk enqueue from DataFrames.

Needs the ``spark`` extra (``pip install "django-dbqueue[spark]"``). PySpark
and pyarrow are imported only when a function that needs them runs, so this
package imports without them and says which extra is missing.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AnalyticsJob": "job",
    "JobResult": "job",
    "enqueue_dataframe": "dataframes",
    "EnqueueResult": "dataframes",
    "export_archive": "export",
    "spark_session": "session",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'django_dbqueue.contrib.spark' has no attribute {name!r}")
    return getattr(import_module(f"django_dbqueue.contrib.spark.{module}"), name)
