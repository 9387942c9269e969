"""From a Django ``DATABASES`` entry to what Spark's JDBC source needs, and the SQL that differs per vendor.

Spark reads through the JDBC drivers Debian packages (MariaDB Connector/J,
PgJDBC, Xerial's SQLite driver). Times leave the database as seconds since
the epoch, computed by the database itself: that is the same number on every
vendor and in every JVM time zone, while a ``DATETIME`` (MySQL, naive UTC)
or SQLite's text timestamps would be read in the JVM's zone or not at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import connections

from ...exceptions import DbQueueError
from .conf import DRIVER_JARS

DRIVERS = {
    "mysql": "org.mariadb.jdbc.Driver",
    "postgresql": "org.postgresql.Driver",
    "sqlite": "org.sqlite.JDBC",
}


class UnsupportedDatabase(DbQueueError):
    """A database Spark's JDBC source cannot be pointed at by django-dbqueue."""


@dataclass(frozen=True)
class JdbcTarget:
    """One database as Spark's JDBC source sees it."""

    vendor: str
    url: str
    properties: dict[str, str] = field(repr=False)
    quote: Any = field(repr=False, compare=False, default=None)

    def epoch(self, column: str) -> str:
        """SQL for a timestamp column as seconds since the epoch (a float; NULL stays NULL)."""
        col = self.quote(column)
        if self.vendor == "mysql":
            # TIMESTAMPDIFF on the naive UTC value: no session time zone involved (UNIX_TIMESTAMP would be).
            return f"(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {col}) / 1000000.0)"
        if self.vendor == "postgresql":
            return f"EXTRACT(EPOCH FROM {col})"
        # Django stores 'YYYY-MM-DD HH:MM:SS[.ffffff]' in UTC. SQLite's date functions keep milliseconds
        # only (and round .9995 up a second), so whole seconds and the microseconds are read apart.
        return f"(CAST(strftime('%s', substr({col}, 1, 19)) AS REAL) + CAST('0' || substr({col}, 20, 7) AS REAL))"

    def timestamp(self, value: datetime) -> str:
        """A literal comparable with a timestamp column (``value`` aware; written in UTC)."""
        # As Django writes it (no ".000000" for whole seconds): SQLite compares timestamps as text.
        text = value.astimezone(UTC).replace(tzinfo=None).isoformat(" ")
        return f"TIMESTAMPTZ '{text}+00'" if self.vendor == "postgresql" else f"'{text}'"


def driver_jar(using: str) -> tuple[str, str]:
    """The default jar of the JDBC driver database ``using`` needs, and the Debian package that installs it."""
    return DRIVER_JARS[jdbc_target(using).vendor]


def jdbc_target(using: str) -> JdbcTarget:
    """Spark's view of the Django database ``using`` (its current settings: a test database in tests)."""
    connection = connections[using]
    settings = connection.settings_dict
    vendor = connection.vendor
    if vendor not in DRIVERS:
        raise UnsupportedDatabase(
            f"database {using!r} is {vendor}; queue analytics read MySQL/MariaDB, PostgreSQL or SQLite"
        )
    properties = {"driver": DRIVERS[vendor]}
    name = settings["NAME"]
    if vendor == "sqlite":
        if not name or str(name) == ":memory:" or str(name).startswith("file:"):
            raise UnsupportedDatabase(f"database {using!r} is an in-memory SQLite database; Spark cannot open it")
        url = f"jdbc:sqlite:{os.path.abspath(name)}"
    else:
        host = settings.get("HOST") or "localhost"
        default_port = "3306" if vendor == "mysql" else "5432"
        port = str(settings.get("PORT") or default_port)
        # jdbc:mysql (allowed for MariaDB's driver by permitMysqlScheme) makes Spark use its MySQL
        # dialect, which quotes names with backticks; under jdbc:mariadb it would write "id", a string.
        scheme = "jdbc:mysql" if vendor == "mysql" else "jdbc:postgresql"
        url = f"{scheme}://{host}:{port}/{name}" + ("?permitMysqlScheme" if vendor == "mysql" else "")
        properties["user"] = settings.get("USER") or ""
        properties["password"] = settings.get("PASSWORD") or ""
    return JdbcTarget(vendor=vendor, url=url, properties=properties, quote=connection.ops.quote_name)
