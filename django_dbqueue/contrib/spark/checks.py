"""System checks of the analytics app (ids in the core's series, unchanged by the move to contrib).

E001 a bad ``DBQUEUE["SPARK_JARS"]`` value (the core's E001 covers its other keys),
W003 a driver jar that does not exist.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from django.core.checks import Error, Warning, register

from ...checks import page
from .conf import is_url, spark_jars, spark_jars_problem


@register()
def check_spark_jars(app_configs: Any = None, **kwargs: Any) -> list[Error | Warning]:
    """A bad value is an error; a missing jar only matters where PySpark is installed (it fails late, inside Spark)."""
    if (problem := spark_jars_problem()) is not None:
        return [
            Error(
                problem,
                hint=f"See the settings reference, {page('docs/settings.md')}, for every key and its default.",
                id="django_dbqueue.E001",
            )
        ]
    if not _installed("pyspark"):
        return []
    return [
        Warning(
            f"DBQUEUE['SPARK_JARS'] lists {jar!r}, which does not exist; queueanalytics cannot load that JDBC driver",
            hint="Install the driver (Debian: libmariadb-java, libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java) "
            f"or set DBQUEUE['SPARK_JARS']. See {page('docs/analytics.md')}.",
            id="django_dbqueue.W003",
        )
        for jar in spark_jars()
        if not is_url(jar) and not os.path.isfile(jar)
    ]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
