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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.transaction import TransactionManagementError
from django.utils.asyncio import async_unsafe

from .capabilities import statement_bytes
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
        or any(not isinstance(wrapper, _SendFirst) for wrapper in connection.execute_wrappers)
        or connection.queries_logged
        or connection.allow_thread_sharing  # threads that share it (LiveServerTestCase) would share one cursor
        or cursor_patched(connection)
        # CONN_HEALTH_CHECKS' test of a reused connection, due once per request (not in django-stubs yet)
        or (getattr(connection, "health_check_enabled", False) and not getattr(connection, "health_check_done", True))
    )


@async_unsafe
def run_on(connection: BaseDatabaseWrapper, sql: str, params: Sequence[Any], read: Callable[[Any], T]) -> T:
    """`run` on a connection the caller has already looked up (``connections[alias]`` costs a thread-local read)."""
    group = connection.__dict__.get(GROUP)
    if group is not None and group.statements:  # what waits goes first, in the same round trip where it can
        answer: Later[T] = Later(connection, read)
        group.statements.append((sql, params, answer))
        group.send(own=answer)
        return answer.get()
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


def _kept(connection: BaseDatabaseWrapper) -> Any:
    """The driver cursor kept on ``connection`` (made anew for a new driver connection)."""
    kept = connection.__dict__.get(KEPT)
    if kept is None or kept[0] is not connection.connection:
        kept = connection.__dict__[KEPT] = (connection.connection, connection.create_cursor())
    return kept[1]


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
        flush(connection)  # statements held back by `grouping` go first
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
        _drop(self.connection, self.driver, cause)

    @async_unsafe
    def send(self, sql: str, params: Sequence[Any]) -> None:
        """Send ``sql`` with ``params``; its rows come from `take`, which must be called before the next `send`."""
        if self.state != self.IDLE or self.rows is not None:
            raise RuntimeError("Pipeline.send: the last statement's answer was not taken")
        flush(self.connection)
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


def _drop(connection: BaseDatabaseWrapper, driver: Any, cause: BaseException | None) -> None:
    """Close a connection out of step: the socket first, in one call of the driver, then Django's state."""
    try:  # noqa: SIM105 - no context manager's call before the socket is shut: one window fewer
        driver.close()
    except Exception:
        pass  # already closed, or gone: closed all the same
    with contextlib.suppress(Exception):
        connection.close()  # in an atomic block: marked for rollback, dropped when the block ends
    if connection.in_atomic_block and cause is not None:
        # The cause of the block's TransactionManagementError (Django's; not in django-stubs yet).
        connection.rollback_exc = cause  # type: ignore[attr-defined]


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


def sends_together(connection: BaseDatabaseWrapper) -> bool:
    """Whether several statements can go to the server in one query on ``connection``, each answered in turn:
    MySQLdb's connection, which mysqlclient opens with multiple statements allowed (as `_pipelines` checks
    it), or psycopg 3's with Django's own client-side binding cursor, and nothing watching statements."""
    if connection.vendor == "mysql":  # unless the project's OPTIONS turned mysqlclient's default off
        return _pipelines(connection) and bool(connection.settings_dict["OPTIONS"].get("multi_statements", True))
    if connection.vendor != "postgresql" or watched(connection):
        return False
    from django.db.backends.postgresql.base import DatabaseWrapper as PostgreSQL
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3 or type(connection).create_cursor is not PostgreSQL.create_cursor:
        return False
    import psycopg

    factory = getattr(connection.connection, "cursor_factory", None)
    return isinstance(factory, type) and issubclass(factory, psycopg.ClientCursor)


def _integrity_codes() -> Any:
    """The MySQL errors Django's backend reports as IntegrityError though the driver raises OperationalError
    (a NOT NULL column given NULL)."""
    from django.db.backends.mysql.base import CursorWrapper as MySQLCursor

    return MySQLCursor.codes_for_integrityerror


# --- statements sent together -------------------------------------------------------------------------

# Where a connection keeps the statements a `grouping` block holds back: a `_Group`.
GROUP = "_dbqueue_group"


class NotRun(DatabaseError):
    """A statement held back by `grouping` that never ran: one before it in its round trip failed, or the
    block ended with an error before it was sent."""


class Later(Generic[T]):
    """The answer of a statement held back by `later`: `get` sends what waits on its connection (this one
    among it) if it has not gone yet, and returns what ``read`` made of the statement's answer, or raises
    what its statement, or ``read``, raised."""

    __slots__ = ("connection", "done", "error", "read", "value")

    def __init__(self, connection: BaseDatabaseWrapper, read: Callable[[Any], T] | None) -> None:
        self.connection, self.read = connection, read
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def get(self) -> T:
        if not self.done:
            flush(self.connection)
        if not self.done:
            raise NotRun("a statement held back by grouping() was never sent")
        if self.error is not None:
            raise self.error
        return cast(T, self.value)

    def _answer(self, cursor: Any) -> None:
        try:
            self.value = None if self.read is None else self.read(cursor)
        except Exception as error:  # ``read``'s check refused the answer: raised once the others are read
            self.error = error
        self.done = True

    def _fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


# A statement held back: its SQL, its parameters (None: its text is sent as it is, "%" and all), its answer.
Held = tuple[str, Sequence[Any] | None, "Later[Any]"]


class _SendFirst:
    """An execute wrapper on a connection for the length of a `grouping` block: any statement that does not go
    through `run` (the ORM's, Django's SAVEPOINT) sends what waits first, so that all run in the order written.
    It is the first wrapper, under any the block's code adds (Django's ``execute_wrapper()`` takes off the last)."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        self.group.send()
        return execute(sql, params, many, context)


class _Group:
    """The statements held back on one connection, in order, each with its `Later`; ``limit``: the bytes one
    query may hold (MySQL's ``max_allowed_packet``; None where unbounded)."""

    def __init__(self, connection: BaseDatabaseWrapper, limit: int | None) -> None:
        self.connection, self.limit = connection, limit
        self.statements: list[Held] = []
        self.guard = _SendFirst(self)

    def hold(self, sql: str, params: Sequence[Any] | None, answer: Later[Any]) -> None:
        self.statements.append((sql, params, answer))

    def release(self) -> list[Held]:
        """Take what waits."""
        statements, self.statements = self.statements, []
        return statements

    def send(self, own: Later[Any] | None = None) -> None:
        """Send what waits, in as few round trips as the connection allows; ``own``: the statement of the caller
        that asked (`run_on`), whose refusal is the caller's to handle.

        A refusal of a statement held back reaches whatever code sent it out
        (any statement does), which may catch it as its own (an INSERT's
        duplicate key): the transaction is then marked for a rollback, so
        that it cannot commit without the refused statement's work.
        """
        statements = self.release()
        if not statements:
            return
        connection = self.connection
        try:
            if not sends_together(connection):  # something began to watch statements: each one through Django's cursor
                _send_one_by_one(connection, statements)
                return
            start = 0
            for end in self._ends(statements):
                try:
                    _send_together(connection, statements[start:end])
                except BaseException:
                    for _, _, rest in statements[end:]:
                        rest._fail(NotRun("a statement before it failed"))
                    raise
                start = end
        except BaseException:
            refused = [a for _, _, a in statements if a is not own and a.error and not isinstance(a.error, NotRun)]
            if refused and connection.in_atomic_block:
                connection.needs_rollback = True
            raise

    def _ends(self, statements: list[Held]) -> Iterator[int]:
        """Where each query's statements end: each query within half the server's limit (the parameters' text
        may grow when quoted), a statement larger than that alone, as it always went."""
        if self.limit is None:
            yield len(statements)
            return
        budget, size = self.limit // 2, 0
        for index, (sql, params, _) in enumerate(statements):
            cost = len(sql) + sum(2 * len(v) if isinstance(v, str | bytes) else 24 for v in params or ())
            if size and size + cost > budget:
                yield index
                size = 0
            size += cost
        yield len(statements)

    def discard(self) -> None:
        for _, _, answer in self.release():
            answer._fail(NotRun("the block that held this statement back ended with an error before it was sent"))


@contextlib.contextmanager
def grouping(using: str) -> Iterator[None]:
    """Hold back statements run with `later` on ``using`` until one must be answered, and send them together.

    A step's acknowledgement on MySQL/MariaDB was eleven round trips, one
    statement after the other, each waited for; most of the statements'
    answers are only checked, or read a little later. Inside this block,
    `later` queues a statement and returns a `Later`; the statements
    queued go out with the next one whose answer is needed (`run`,
    `Later.get`), in one query where the driver takes several statements
    (`sends_together`: mysqlclient's and psycopg's connections), and what still
    waits goes out when the block ends. Their answers are read in order:
    a statement the server refuses stops the ones after it (they raise
    `NotRun`), and a ``read`` that refuses its answer raises once all of
    the round trip's answers are read. Any other statement on the
    connection (the ORM's, a savepoint) sends what waits first, so nothing
    runs out of the order written. Elsewhere (SQLite, a watched
    connection, psycopg2) `later` runs the statement at once.

    Only inside a transaction, as the body of a block that rolls back on
    any exception: if the block ends with one, what still waits is
    dropped, unsent. Blocks nest: the outermost one sends.
    """
    connection = connections[using]
    if GROUP in connection.__dict__:
        yield
        return
    if not connection.in_atomic_block and connection.get_autocommit():
        raise TransactionManagementError("grouping() holds statements back only inside a transaction")
    if not sends_together(connection):
        yield
        return
    limit = statement_bytes(using)  # read before anything waits: it may be a statement of its own
    group = connection.__dict__[GROUP] = _Group(connection, limit)
    connection.execute_wrappers.insert(0, group.guard)
    try:
        yield
        group.send()
    except BaseException:
        group.discard()
        raise
    finally:
        connection.__dict__.pop(GROUP, None)
        group.release()
        with contextlib.suppress(ValueError):
            connection.execute_wrappers.remove(group.guard)


def later(using: str, sql: str, params: Sequence[Any] | None, read: Callable[[Any], T] | None = None) -> Later[T]:
    """Run ``sql`` when the next statement on ``using`` must be answered, or the `grouping` block ends; at
    once outside such a block. ``read`` (None: the answer is not wanted) runs on the cursor once it has run:
    it reads the cursor and nothing else (the cursor is the connection's, with more answers behind)."""
    connection = connections[using]
    answer: Later[T] = Later(connection, read)
    group = connection.__dict__.get(GROUP)
    if group is not None and not watched(connection):
        group.hold(sql, params, answer)
    else:  # outside a block, or something watches statements now (it sees this one, after what waits)
        if group is not None:
            group.send()
        _send_one_by_one(connection, [(sql, params, answer)])
    return answer


def only_unread(connection: BaseDatabaseWrapper) -> bool:
    """Whether statements wait on ``connection`` and none of their answers is wanted (no ``read``)."""
    group = connection.__dict__.get(GROUP)
    return group is not None and bool(group.statements) and all(a.read is None for _, _, a in group.statements)


def discard(connection: BaseDatabaseWrapper) -> None:
    """Drop what waits on ``connection`` unsent: its transaction is being rolled back."""
    group = connection.__dict__.get(GROUP)
    if group is not None:
        group.discard()


def flush(connection: BaseDatabaseWrapper) -> None:
    """Send what waits on ``connection`` (`grouping`), if anything does."""
    group = connection.__dict__.get(GROUP)
    if group is not None:
        group.send()


def _send_one_by_one(connection: BaseDatabaseWrapper, statements: list[Held]) -> None:
    """Each statement in its own round trip, through `run_on`'s path; stops at the first that fails."""
    for index, (sql, params, answer) in enumerate(statements):
        try:
            run_on(connection, sql, params if params is not None else None, answer._answer)  # type: ignore[arg-type]
        except BaseException as error:
            answer._fail(error)
            for _, _, rest in statements[index + 1 :]:
                rest._fail(NotRun("a statement before it in its round trip failed"))
            raise
    _raise_refused(statements)


def _raise_refused(statements: list[Held]) -> None:
    """Raise the first answer a ``read`` refused, once every answer is read."""
    for _, _, answer in statements:
        if answer.error is not None:
            raise answer.error


@async_unsafe
def _send_together(connection: BaseDatabaseWrapper, statements: list[Held]) -> None:
    """The statements in one query on the kept cursor, their answers read in turn (``nextset``).

    The server runs them in order and stops at the first it refuses: that
    one raises, the ones after it never ran. A MySQL answer read only in
    part (an interruption, or a failure on this side of the wire) leaves
    the connection out of step with the server: it is closed then, as
    `Pipeline` closes one.
    """
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    sql = "; ".join(text if params is not None else text.replace("%", "%%") for text, params, _ in statements)
    values = [value for _, params, _ in statements for value in (params or ())]
    cursor = _kept(connection)
    mysql = connection.vendor == "mysql"
    read = 0  # how many answers were read
    try:
        with connection.wrap_database_errors:  # the driver's errors become Django's
            try:
                cursor.execute(sql, values)
                for index, (_, _, answer) in enumerate(statements):
                    if index and not cursor.nextset():
                        raise DatabaseError(f"{len(statements)} statements sent, {index} answered")
                    answer._answer(cursor)
                    read = index + 1
            except Exception as error:
                if mysql and _server_error(error) and mysql_code(error) in _integrity_codes():
                    raise connection.connection.IntegrityError(*error.args) from error
                raise
    except Exception as error:
        if mysql and not _server_error(error):
            raise  # this side's failure: the wire is unknown (below)
        if mysql:  # the answers stop at the refusal: the statement read next is the one refused
            statements[read][2]._fail(error)
            for _, _, rest in statements[read + 1 :]:
                rest._fail(NotRun("a statement before it in its round trip failed"))
        else:  # PostgreSQL reads every answer before execute() returns, and does not say which one it refused
            for _, _, answer in statements:
                answer._fail(error)
        read = len(statements)
        raise
    finally:
        if read < len(statements) and mysql:  # interrupted, or failed on this side, mid-answer
            for _, _, rest in statements[read:]:
                rest._fail(NotRun("the connection was closed before its answer was read"))
            _drop(connection, connection.connection, sys.exception())
    _raise_refused(statements)
