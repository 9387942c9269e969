"""System checks: the DBQUEUE setting and what the queue's databases can do.

Ids are stable: E001 setting, E002 no SKIP LOCKED, W001 REPEATABLE READ,
W003 a missing JDBC driver for the Spark analytics, E003 a schedule declared
in code that is invalid (one in DBQUEUE["SCHEDULES"] is E001's);
W002 (a Tasks backend queue without ARCHIVE) is reported by DatabaseQueueBackend.check().
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from urllib.parse import urlsplit

from django.core.checks import Error, Tags, Warning, register

from .conf import find_problems, get_settings, raw_setting
from .db import capabilities

DOCS = "docs/settings.md"


@register()
def check_setting(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    return [
        Error(problem, hint=f"See {DOCS} for every key and its default.", id="django_dbqueue.E001")
        for problem in find_problems(raw_setting())
    ]


@register()
def check_schedules(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Schedules declared with ``@schedule``: each problem names the schedule and the field."""
    from .schedules.registry import declared

    return [
        Error(problem, hint="See docs/schedules.md for every field.", id="django_dbqueue.E003")
        for problem in declared()[1]
    ]


@register()
def check_spark_jars(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """Only where PySpark is installed: a missing driver jar fails ``queueanalytics`` late, inside Spark."""
    if find_problems(raw_setting()) or not _installed("pyspark"):
        return []
    return [
        Warning(
            f"DBQUEUE['SPARK_JARS'] lists {jar!r}, which does not exist; queueanalytics cannot load that JDBC driver",
            hint="Install the driver (Debian: libmariadb-java, libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java) "
            "or set DBQUEUE['SPARK_JARS']. See docs/analytics.md.",
            id="django_dbqueue.W003",
        )
        for jar in get_settings().spark_jars
        if not _is_url(jar) and not os.path.isfile(jar)
    ]


def _is_url(jar: str) -> bool:
    """hdfs://, https://, local:/ ...: Spark fetches those itself (a one-letter scheme is a Windows drive)."""
    return len(urlsplit(jar).scheme) > 1


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _queue_databases() -> set[str]:
    if find_problems(raw_setting()):
        return set()
    dbq = get_settings()
    return {dbq.defaults.database} | {options.database for options in dbq.queues.values()}


@register(Tags.database)
def check_databases(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Error | Warning]:
    """Run only with ``--database`` (Django does not touch databases otherwise)."""
    messages: list[Error | Warning] = []
    for alias in sorted(_queue_databases() & set(databases or ())):
        if capabilities.lacks_skip_locked(alias):
            messages.append(
                Error(
                    f"database {alias!r} cannot SELECT ... FOR UPDATE SKIP LOCKED; "
                    "django-dbqueue needs MySQL >= 8.0.1, MariaDB >= 10.6 or PostgreSQL",
                    hint="See docs/databases.md.",
                    id="django_dbqueue.E002",
                )
            )
        if capabilities.runs_repeatable_read(alias):
            messages.append(
                Warning(
                    f"database {alias!r} runs at REPEATABLE READ; queue operations want READ COMMITTED "
                    "(a claim inside a longer transaction would not see newer messages, "
                    "and gap locks make deadlocks more likely)",
                    hint="Set DATABASES[...]['OPTIONS']['isolation_level'] = 'read committed' (Django's default). "
                    "See docs/databases.md.",
                    id="django_dbqueue.W001",
                )
            )
    return messages
