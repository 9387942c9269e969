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

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.utils.asyncio import async_unsafe

from .errors import mysql_code

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


def watched(connection: BaseDatabaseWrapper) -> bool:
    """Whether a statement must go through ``connection.cursor()``: something watches statements, or the
    connection needs Django's care first (see the module's docstring)."""
    return bool(
        connection.connection is None
        or connection.execute_wrappers
        or connection.queries_logged
        or connection.allow_thread_sharing  # threads that share it (LiveServerTestCase) would share one cursor
        or cursor_patched(connection)
        # CONN_HEALTH_CHECKS' test of a reused connection, due once per request (not in django-stubs yet)
        or (getattr(connection, "health_check_enabled", False) and not getattr(connection, "health_check_done", True))
    )


@async_unsafe
def run_on(connection: BaseDatabaseWrapper, sql: str, params: Sequence[Any], read: Callable[[Any], T]) -> T:
    """`run` on a connection the caller has already looked up (``connections[alias]`` costs a thread-local read)."""
    driver = connection.connection
    if watched(connection):
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


def _fetchall(cursor: Any) -> list[Any]:
    return list(cursor.fetchall()) if cursor.description else []


class Pipeline:
    """Statements sent one at a time, each answer read when the caller asks for it: what the caller does in
    between runs while the server executes.

    ``enqueue_many`` on MySQL/MariaDB spent about a third of its time
    building messages while the server waited, then waited while the server
    inserted them. Where the driver is MySQLdb's own connection under
    Django's own MySQL backend (it can send a statement and read its answer
    later: ``send_query``, ``read_query_result``; a tracer's proxy around it,
    or a backend that wraps its cursors, is not trusted with that) and
    nothing watches statements (`run_on`'s conditions), `send` returns as
    soon as the statement is on its way, and `take` reads its rows.
    Elsewhere `send` runs it at once through `run_on`. One statement in
    flight at most, and the caller must not run any other statement on the
    connection (nor code that might) between the two.

    Leaving the ``with`` block reads an answer still due (a refusal read
    there gives way to the error that ended the block; an interruption does
    not). Where an exception (Ctrl-C, a timeout's signal) came while the
    driver was sending or reading, or the driver failed on this side of the
    wire, nobody knows what is left on it: reading again could wait for an
    answer that never comes, or read the wrong one. The connection is
    closed then, as MySQLdb closes one it cannot trust, which ends the
    transaction it was in (inside an ``atomic()`` block, the block's next
    query raises TransactionManagementError, from the interruption). A
    second interruption in the few bytecodes before the socket is shut
    cannot be guarded against in Python.
    """

    IDLE, SENDING, SENT, READING = "idle", "sending", "sent", "reading"

    def __init__(self, using: str) -> None:
        self.connection = connection = connections[using]
        driver = connection.connection
        self.driver = driver if connection.vendor == "mysql" and _pipelines(connection) else None
        self.rows: list[Any] | None = None  # the answer of a statement run at once
        self.state = self.IDLE

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            if self.state == self.SENT:  # nothing read yet: the whole answer is on its way
                self.take()
        except DatabaseError:
            if error is None:
                raise
            # the server's refusal, read: the error that ended the block is the one raised
        finally:
            if self.state != self.IDLE:  # interrupted while sending or reading
                self._drop(sys.exception() or error)

    def _drop(self, cause: BaseException | None) -> None:
        """Close a connection out of step: the socket first, in one call of the driver, then Django's state."""
        driver = self.driver
        try:  # noqa: SIM105 - no context manager's call before the socket is shut: one window fewer
            driver.close()  # type: ignore[union-attr]  # a state other than idle has a driver
        except Exception:
            pass  # already closed, or gone: closed all the same
        connection = self.connection
        with contextlib.suppress(Exception):
            connection.close()  # in an atomic block: marked for rollback, dropped when the block ends
        if connection.in_atomic_block and cause is not None:
            # The cause of the block's TransactionManagementError (Django's; not in django-stubs yet).
            connection.rollback_exc = cause  # type: ignore[attr-defined]

    @async_unsafe
    def send(self, sql: str, params: Sequence[Any]) -> None:
        """Send ``sql`` with ``params``; its rows come from `take`, which must be called before the next `send`."""
        if self.state != self.IDLE or self.rows is not None:
            raise RuntimeError("Pipeline.send: the last statement's answer was not taken")
        driver = self.driver
        if driver is None:
            self.rows = run_on(self.connection, sql, params, _fetchall)
            return
        self.connection.validate_thread_sharing()
        self.connection.validate_no_broken_transaction()
        query = sql.encode(driver.encoding) % tuple(map(driver.literal, params))  # as MySQLdb's cursor formats it
        with self.connection.wrap_database_errors:
            self.state = self.SENDING
            driver.send_query(query)  # a failure here is this side's: the state stays, and the block drops it
            self.state = self.SENT

    def take(self) -> list[Any]:
        """The rows of the statement last sent (none for a statement that returns none), once it has run."""
        if self.state == self.IDLE:
            rows, self.rows = self.rows, None
            if rows is None:
                raise RuntimeError("Pipeline.take: no statement was sent")
            return rows
        if self.state != self.SENT:
            raise RuntimeError(f"Pipeline.take: the connection is out of step ({self.state})")
        driver = self.driver
        assert driver is not None
        with self.connection.wrap_database_errors:
            self.state = self.READING
            try:
                driver.read_query_result()
                # RETURNING's rows come after the answer's head: a row the server refuses midway (a
                # trigger's) ends them with the error, raised here.
                result = driver.store_result()
            except driver.Error as e:
                if _server_error(e):
                    self.state = self.IDLE  # the server's refusal ended the answer
                if mysql_code(e) in _integrity_codes():
                    raise driver.IntegrityError(*e.args) from e
                raise
            self.state = self.IDLE  # the whole answer is in ``result``, on this side
        return list(result.fetch_row(0)) if result is not None else []


def _server_error(error: Exception) -> bool:
    """Whether a driver error is the server's answer (its code outside the client's 2000 to 2999): the answer
    ended with it. The client's own (a lost connection, a lock already held) leave the wire unknown."""
    code = mysql_code(error)
    return code is not None and not 2000 <= code < 3000


def _pipelines(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements can be sent on ``connection`` and answered later: its driver is a MySQLdb connection
    itself (not a tracer's proxy around one), its backend's cursors are Django's MySQL backend's (not a
    subclass's that measures them), and nothing watches its statements."""
    kind = type(connection.connection)
    if (kind.__module__, kind.__qualname__) != ("MySQLdb.connections", "Connection"):
        return False
    from django.db.backends.mysql.base import DatabaseWrapper as MySQL

    return type(connection).create_cursor is MySQL.create_cursor and not watched(connection)


def _integrity_codes() -> Any:
    """The MySQL errors Django's backend reports as IntegrityError though the driver raises OperationalError
    (a NOT NULL column given NULL)."""
    from django.db.backends.mysql.base import CursorWrapper as MySQLCursor

    return MySQLCursor.codes_for_integrityerror
