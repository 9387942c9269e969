"""The hot path's statements on the driver's cursor, kept per connection, when nothing watches them.

``connection.cursor()`` makes a driver cursor and Django's wrapper for each
statement, and closes both after it: about a sixth of a single enqueue's
CPU time. `run` sends a statement on one driver cursor kept per connection
(made by the backend's ``create_cursor``, so its own translations hold),
with the checks Django makes of every statement (not from an event loop,
not in a broken transaction) and its error translation; a connection that
threads are allowed to share keeps none. Whenever something watches statements (an
``execute_wrapper``, DEBUG's or ``assertNumQueries``' query log, a tool
that patched Django's cursor as APM agents and the debug toolbar do) or
the connection needs Django's care first (not open yet, a health check
due), the statement goes through ``connection.cursor()`` like any other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.utils.asyncio import async_unsafe

T = TypeVar("T")

# Where a connection keeps its driver cursor: (the driver connection it belongs to, the cursor).
KEPT = "_dbqueue_kept_cursor"


# Django's own CursorWrapper.execute is defined there; an agent's replacement, even one made with
# functools.wraps (which copies the name, not the code), is not.
DJANGO_CURSOR_FILE = os.path.join("django", "db", "backends", "utils.py")


def cursor_patched(connection: Any) -> bool:
    """Whether a tool wraps Django's statements: ``CursorWrapper.execute`` replaced (Sentry, other APM
    agents), or this connection's ``cursor()`` (the debug toolbar)."""
    code = getattr(CursorWrapper.execute, "__code__", None)
    return code is None or not cast(str, code.co_filename).endswith(DJANGO_CURSOR_FILE) or "cursor" in vars(connection)


def run(using: str, sql: str, params: Sequence[Any], read: Callable[[Any], T]) -> T:
    """Execute ``sql`` with ``params`` on database ``using``; returns ``read(cursor)`` (fetch the rows there)."""
    return run_on(connections[using], sql, params, read)


@async_unsafe
def run_on(connection: BaseDatabaseWrapper, sql: str, params: Sequence[Any], read: Callable[[Any], T]) -> T:
    """`run` on a connection the caller has already looked up (``connections[alias]`` costs a thread-local read)."""
    driver = connection.connection
    if (
        driver is None
        or connection.execute_wrappers
        or connection.queries_logged
        or connection.allow_thread_sharing  # threads that share it (LiveServerTestCase) would share one cursor
        or cursor_patched(connection)
        # CONN_HEALTH_CHECKS' test of a reused connection, due once per request (not in django-stubs yet)
        or (getattr(connection, "health_check_enabled", False) and not getattr(connection, "health_check_done", True))
    ):
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return read(cursor)
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    kept = connection.__dict__.get(KEPT)
    with connection.wrap_database_errors:
        if kept is None or kept[0] is not driver:  # a new connection since: the old cursor went with the old one
            kept = connection.__dict__[KEPT] = (driver, connection.create_cursor())
        cursor = kept[1]
        cursor.execute(sql, params)
        return read(cursor)
