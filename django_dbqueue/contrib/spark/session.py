"""Starting Spark: the one place that imports PySpark and hands it the JDBC drivers."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from ...exceptions import DbQueueError
from .conf import is_url, jars_configured, spark_jars

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


def java_command() -> str | None:
    """The ``java`` PySpark will start: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        return java if os.access(java, os.X_OK) else None
    return shutil.which("java")


def prerequisite_problems(using: str | None) -> list[str]:
    """What Spark would lack, each with what provides it, checked before it starts (which takes seconds
    and ends in a Java stack trace): PySpark, Java, and the JDBC driver jar of database ``using`` (None:
    no database is read, as with Parquet in). Empty when all is there.
    """
    problems = []
    if importlib.util.find_spec("pyspark") is None:
        problems.append("PySpark is not installed: pip install 'django-dbqueue[spark]'")
    if java_command() is None:
        where = (
            f"JAVA_HOME ({os.environ['JAVA_HOME']}) has no bin/java"
            if os.environ.get("JAVA_HOME")
            else ("no java on PATH and JAVA_HOME is not set")
        )
        problems.append(
            f"Java is not installed ({where}): Spark needs Java 17 (Debian: apt install default-jre-headless)"
        )
    missing = [jar for jar in spark_jars() if not is_url(jar) and not os.path.isfile(jar)]
    if jars_configured():
        problems += [
            f"the JDBC driver jar {jar} does not exist: DBQUEUE['SPARK_JARS'] lists it (see docs/analytics.md)"
            for jar in missing
        ]
    elif using is not None:
        from .jdbc import driver_jar

        jar, package = driver_jar(using)
        if jar in missing:
            problems.append(
                f"the JDBC driver jar {jar} does not exist: install it (Debian: apt install {package}) or list "
                "the driver jar you have in DBQUEUE['SPARK_JARS'] (see docs/analytics.md)"
            )
    return problems


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
