"""Starting Spark: the one place that imports PySpark and hands it the JDBC drivers."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from ...exceptions import DbQueueError
from .conf import spark_jars

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class MissingExtra(DbQueueError):
    """PySpark or pyarrow is not installed."""


def require(module: str) -> ModuleType:
    """Import ``module`` (pyspark, pyarrow) or fail naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"{module} is not installed; queue analytics need the 'spark' extra: pip install 'django-dbqueue[spark]'"
        ) from exc


def spark_session(master: str = "local[*]", app_name: str = "django-dbqueue analytics") -> SparkSession:
    """A Spark session with ``SPARK_JARS`` on its class path and UTC as its time zone.

    Reuses the running session if there is one (its master stays what it was).
    ``spark.jars`` ships the drivers to a cluster's executors too.
    """
    require("pyspark")
    from pyspark.sql import SparkSession

    if master.startswith("local"):
        # Python workers run this interpreter (with Django and django-dbqueue), not whatever
        # "python3" is first on PATH. On a cluster, set PYSPARK_PYTHON for the executors' hosts.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    jars = ",".join(spark_jars())
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        # Re-running a window replaces only that window's hours in --parquet-out.
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
    )
    if jars:
        builder = builder.config("spark.jars", jars)
    return builder.getOrCreate()
