"""The analytics' one setting, ``DBQUEUE["SPARK_JARS"]``: read and checked here, nowhere else."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ...conf import raw_setting

# Where Debian's packages put the JDBC drivers (libmariadb-java,
# libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java). See docs/analytics.md.
DEFAULT_JARS = (
    "/usr/share/java/mariadb-java-client.jar",
    "/usr/share/java/postgresql.jar",
    "/usr/share/java/sqlite-jdbc.jar",
)
# Each database's driver: its default jar and the Debian package that installs it.
DRIVER_JARS = {
    "mysql": ("/usr/share/java/mariadb-java-client.jar", "libmariadb-java"),
    "postgresql": ("/usr/share/java/postgresql.jar", "libpostgresql-jdbc-java"),
    "sqlite": ("/usr/share/java/sqlite-jdbc.jar", "libxerial-sqlite-jdbc-java"),
}


def is_url(jar: str) -> bool:
    """hdfs://, https://, local:/ ...: Spark fetches those itself (a one-letter scheme is a Windows drive)."""
    return len(urlsplit(jar).scheme) > 1


def jars_configured() -> bool:
    """Whether the project lists its jars in ``SPARK_JARS`` (else the Debian defaults are used)."""
    raw = raw_setting()
    return isinstance(raw, dict) and "SPARK_JARS" in raw


def jar_list_problem(value: Any) -> str | None:
    """A list of paths (or URLs) of ``.jar`` files: the JDBC drivers Spark loads."""
    if not isinstance(value, list | tuple) or not all(isinstance(jar, str) and jar for jar in value):
        return f"must be a list of paths to .jar files, not {value!r}"
    for jar in value:
        if not jar.endswith(".jar"):
            return f"lists {jar!r}, which is not a .jar file"
        if "," in jar:
            return f"lists {jar!r}; a path must not contain a comma (Spark joins the list with commas)"
    return None


def spark_jars_problem() -> str | None:
    """The sentence for a bad ``SPARK_JARS`` value, or None."""
    raw = raw_setting()
    if not isinstance(raw, dict) or "SPARK_JARS" not in raw:
        return None
    why = jar_list_problem(raw["SPARK_JARS"])
    return None if why is None else f"DBQUEUE['SPARK_JARS'] {why}"


def spark_jars() -> list[str]:
    """The driver jars Spark loads (``spark.jars``, which also ships them to a cluster's executors)."""
    raw = raw_setting()
    value = raw.get("SPARK_JARS", DEFAULT_JARS) if isinstance(raw, dict) else DEFAULT_JARS
    if (why := jar_list_problem(value)) is not None:
        from ...exceptions import ImproperlyConfiguredQueue

        raise ImproperlyConfiguredQueue(f"DBQUEUE['SPARK_JARS'] {why}")
    return list(value)
