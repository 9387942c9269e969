"""Everything that differs between MySQL/MariaDB, PostgreSQL and SQLite.

This package is the only place that asks which database it talks to
(``connection.vendor``, MariaDB or MySQL): the clock, transactions and
locks, transient errors and their retries, wake-up notifications,
hand-written SQL fragments, planner statistics and isolation checks. The
rest of django-dbqueue is plain ORM over these helpers; a test fails when
``connection.vendor`` shows up anywhere else (tests/test_layers.py).
"""

from __future__ import annotations

from django.db import connections


def vendor(using: str) -> str:
    """``mysql`` (MySQL and MariaDB), ``postgresql`` or ``sqlite``."""
    return connections[using].vendor


def describe(using: str) -> str:
    """The server's name and version, for people: ``MariaDB 10.11.6``, ``PostgreSQL 15.4``, ``SQLite 3.40.1``."""
    connection = connections[using]
    try:
        version = ".".join(map(str, connection.get_database_version()))
    except Exception:  # the banner says what it can; the worker's first query will report the trouble
        return connection.display_name
    return f"{connection.display_name} {version}"
