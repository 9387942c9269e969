"""The database server's clock: leases, availability and expiry never read a worker's clock.

Workers on many hosts with skewed clocks agree because every time the
queue compares or stores comes from the one database server.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import django
from django.db import connections
from django.db.models import DateTimeField, Func
from django.db.models.sql import Query
from django.utils import timezone
from django.utils.dateparse import parse_datetime

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models.sql.compiler import SQLCompiler


class DbNow(Func):
    """The database server's current time in UTC, plus ``seconds``.

    Django's ``Now()`` renders ``CURRENT_TIMESTAMP`` on MySQL, which is in the
    session's time zone; we store UTC, so MySQL gets ``UTC_TIMESTAMP``.
    """

    template = "CURRENT_TIMESTAMP"
    output_field = DateTimeField()

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds = float(seconds)

    def as_mysql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any) -> tuple[str, list[Any]]:
        if self.seconds:
            return "(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)", [round(self.seconds * 1_000_000)]
        return "UTC_TIMESTAMP(6)", []

    def as_postgresql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> tuple[str, list[Any]]:
        # STATEMENT_TIMESTAMP(), not NOW(): NOW() is frozen at the transaction's start.
        if self.seconds:
            return "(STATEMENT_TIMESTAMP() + make_interval(secs => %s))", [self.seconds]
        return "STATEMENT_TIMESTAMP()", []

    # The parameters stay a list, as Django 5.2 expects; django-stubs types them as Django 6's tuple.
    def as_sqlite(  # type: ignore[override]
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> tuple[str, list[Any]]:
        # Django stores datetimes in SQLite as UTC text with six fractional
        # digits; SQLite's clock has three. Pad, so that text compares like
        # with like: a time Django wrote in this very millisecond is not later than now.
        if self.seconds:
            return "(STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s) || '000')", [f"{self.seconds:+.6f} seconds"]
        return "(STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now') || '000')", []


def compile_now(using: str, seconds: float = 0.0) -> tuple[str, list[Any]]:
    """``DbNow(seconds)`` as SQL and parameters, for hand-written statements."""
    connection = connections[using]
    if not seconds and connection.vendor in _NOW_SQL:  # the hot path's statements ask for it on every call
        return _NOW_SQL[connection.vendor], []
    sql, params = Query(None).get_compiler(connection=connection).compile(DbNow(seconds))
    if not seconds and not params:
        _NOW_SQL[connection.vendor] = sql
    return sql, list(params)


_NOW_SQL: dict[str, str] = {}


def now_plus_seconds(using: str) -> str:
    """The database clock plus ``%s`` seconds (a parameter), for a statement written once and run with many values.

    Only the statements that exist where `writable_ctes` holds use it.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise NotImplementedError(f"now_plus_seconds() is written for PostgreSQL only, not {connection.vendor}")
    now, _ = compile_now(using)
    return f"{now} + make_interval(secs => %s)"


def db_now(using: str) -> datetime:
    """Read the database server's clock (one query), as an aware UTC datetime."""
    sql, params = compile_now(using)
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {sql}", params)
        raw: datetime | str = cursor.fetchone()[0]
    return aware_clock(raw)


def aware_clock(raw: datetime | str) -> datetime:
    """A reading of the database's clock (``SELECT`` of `DbNow`) as an aware UTC datetime."""
    # SQLite answers with text; MySQL with a naive datetime in UTC.
    value = raw if isinstance(raw, datetime) else parse_datetime(raw)
    if value is None:
        raise ValueError(f"the database's clock read {raw!r}, which is not a time")
    if timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value


def insert_returns_expressions(using: str) -> bool:
    """Whether an INSERT hands back the values the database computed for it (``DbNow()``).

    Django 6 asks for them with RETURNING where the database has it
    (PostgreSQL, MariaDB, SQLite); Django 5.2 and MySQL do not.
    """
    return django.VERSION >= (6, 0) and connections[using].features.can_return_columns_from_insert
