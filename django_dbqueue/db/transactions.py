"""Short write transactions and the cross-process lock the reaper runs under."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Protocol, cast

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError

from . import cursors

logger = logging.getLogger("django_dbqueue")


class TransactionMode(Protocol):
    """SQLite's ``transaction_mode`` (Django 5.1+): the BEGIN it issues; not in django-stubs yet."""

    transaction_mode: str | None


def after_commit(using: str, action: Callable[[], None]) -> None:
    """Run ``action`` once the caller's transaction on ``using`` commits: at once in autocommit.

    ``transaction.on_commit`` does the same, but outside ``atomic()`` it still
    does its bookkeeping on every call: the enqueue path calls this per message.
    """
    if connections[using].in_atomic_block:
        transaction.on_commit(action, using=using)
    else:
        action()


@contextlib.contextmanager
def write_transaction(using: str) -> Iterator[None]:
    """A short transaction that reads and then writes (claim, ack, archive, replay).

    MySQL and PostgreSQL lock the rows they pick with ``SKIP LOCKED``. SQLite
    has no row locks: there the transaction takes the database's write lock
    at ``BEGIN IMMEDIATE``, so writers queue up on the lock (with the
    connection's timeout) instead of reading first and then failing to
    upgrade to a write lock ("database is locked"). Inside an outer
    transaction the outer one decides.
    """
    connection = connections[using]
    if connection.vendor != "sqlite" or connection.in_atomic_block:
        with transaction.atomic(using=using):
            yield
        return
    connection.ensure_connection()
    sqlite = cast(TransactionMode, connection)
    previous = sqlite.transaction_mode
    sqlite.transaction_mode = "IMMEDIATE"
    try:
        with transaction.atomic(using=using):
            sqlite.transaction_mode = previous
            yield
    finally:
        sqlite.transaction_mode = previous


@contextlib.contextmanager
def short_transaction(using: str) -> Iterator[None]:
    """`write_transaction` in the fewest round trips, for the worker's claim and acknowledgement.

    Django's ``atomic()`` turns autocommit off before a transaction and on
    again after it; on MySQL and MariaDB each switch is a statement the
    server answers (``SET autocommit``), so a transaction of two statements
    costs five round trips instead of four. Here, on an autocommit
    connection outside any ``atomic()``, the server gets ``START TRANSACTION``
    ... ``COMMIT`` instead, and Django's own state says "in a transaction"
    as ``atomic()`` leaves it: ``on_commit`` hooks run once the COMMIT
    succeeds (and are dropped on a rollback; one that raises is logged),
    ``select_for_update`` and a nested ``atomic()`` work inside. Whatever
    goes wrong is rolled back, and so is a transaction Django marked for a
    rollback or whose connection was closed inside (with an error: nothing
    was committed); a connection whose state is then unknown is closed,
    never reused mid-transaction. PostgreSQL through psycopg 3 gets the
    same (`_begins_itself`), which spares psycopg's own ``BEGIN`` a round
    trip. Elsewhere (SQLite, psycopg2, inside ``atomic()``) this is
    `write_transaction`.
    """
    connection = connections[using]
    if not _begins_itself(connection):
        with write_transaction(using):
            yield
        return
    # Django's view of the session, as atomic() sets it, without the SET autocommit=0 that atomic()
    # would send: the server's autocommit stays on, suspended by START TRANSACTION until COMMIT.
    connection.autocommit = False
    try:
        with cursors.grouping(using):  # START TRANSACTION goes out with the first statement answered
            cursors.later(using, "START TRANSACTION", None)
            try:
                # Outside atomic() with autocommit off, Django takes the session for a transaction already
                # begun: no savepoint (savepoint=False), no commit at its end; its hooks wait for ours.
                with transaction.atomic(using=using, savepoint=False):
                    yield
            except BaseException:
                cursors.discard(connection)
                _abandon(connection)
                raise
            if connection.closed_in_transaction or connection.needs_rollback:
                # The body closed the connection, or caught an error Django had marked for a rollback.
                why = "closed" if connection.closed_in_transaction else "marked for a rollback"
                cursors.discard(connection)
                _abandon(connection)
                raise TransactionManagementError(f"the transaction was {why} inside short_transaction: not committed")
            try:
                _commit(connection)
            except BaseException:
                _abandon(connection)
                raise
    finally:
        connection.autocommit = True
    _run_hooks(connection)


def _begins_itself(connection: BaseDatabaseWrapper) -> bool:
    """Whether `short_transaction` may begin its transaction by a statement of its own on ``connection``:
    an autocommit connection outside ``atomic()``, on MySQL/MariaDB, or on PostgreSQL through psycopg 3
    where statements go out together (`cursors.grouping`) and the driver's own ``BEGIN`` would say nothing
    more (no isolation level, read-only or deferrable mode set on it). psycopg 3 commits and rolls back a
    transaction a statement began; psycopg2, in autocommit, ignores both."""
    if connection.vendor not in ("mysql", "postgresql") or connection.in_atomic_block:
        return False
    if not connection.get_autocommit():  # connects, if needed
        return False
    if connection.vendor == "mysql":
        return True
    driver = connection.connection
    if not cursors.sends_together(connection):
        return False
    return all(getattr(driver, name, None) is None for name in ("isolation_level", "read_only", "deferrable"))


def _commit(connection: BaseDatabaseWrapper) -> None:
    """COMMIT, in one round trip with the statements still waiting when no answer of theirs is wanted: a
    statement the server refuses stops the COMMIT after it. Else what waits goes first, then Django's commit."""
    if cursors.only_unread(connection):
        cursors.later(connection.alias, "COMMIT", None)
        cursors.flush(connection)
        connection.errors_occurred = False  # as Django's commit() notes a working connection
        return
    cursors.flush(connection)
    connection.commit()


def _abandon(connection: BaseDatabaseWrapper) -> None:
    """Roll `short_transaction`'s transaction back (its on_commit hooks dropped), or close a connection
    whose state is unknown; leave Django's state outside any transaction either way."""
    if connection.closed_in_transaction:  # Django left it "in atomic" with no connection: start afresh
        connection.in_atomic_block = False
        connection.closed_in_transaction = False
        connection.needs_rollback = False
        connection.run_on_commit = []
        connection.connection = None
        return
    connection.in_atomic_block = False
    connection.run_on_commit = []
    connection.needs_rollback = False
    try:
        connection.rollback()
    except Exception:  # the caller's error is the one to raise: the connection's state is unknown, drop it
        with contextlib.suppress(Exception):
            connection.close()
        connection.connection = None


def _run_hooks(connection: BaseDatabaseWrapper) -> None:
    """The on_commit hooks of a committed `short_transaction`, each one whatever the others do: a hook
    that raises is logged, never taken for the transaction's failure (its caller would retry what committed)."""
    hooks, connection.run_on_commit = connection.run_on_commit, []
    connection.run_commit_hooks_on_set_autocommit_on = False
    for entry in hooks:  # (savepoint ids, hook, robust)
        try:
            entry[1]()
        except Exception:
            logger.exception("an on_commit hook of a committed transaction on %r raised", connection.alias)


@contextlib.contextmanager
def try_lock(using: str, name: str) -> Iterator[bool]:
    """A session-level lock that at most one process holds; yields whether we got it.

    MySQL's ``GET_LOCK`` and PostgreSQL's advisory locks are released when the
    holder's connection drops, so a reaper that dies frees the lock. SQLite
    has a single writer anyway: there every caller gets it.
    """
    connection = connections[using]
    if connection.vendor == "sqlite":
        yield True
        return
    acquire, release = {
        "mysql": ("SELECT GET_LOCK(%s, 0)", "SELECT RELEASE_LOCK(%s)"),
        "postgresql": ("SELECT pg_try_advisory_lock(hashtext(%s))", "SELECT pg_advisory_unlock(hashtext(%s))"),
    }[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(acquire, [name])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held and connection.connection is not None:
            with contextlib.suppress(Exception), connection.cursor() as cursor:
                cursor.execute(release, [name])


def lock_name(using: str, purpose: str) -> str:
    """A lock name for ``purpose`` on database ``using``.

    MySQL's lock names are server-wide (64 characters at most): naming the
    database keeps processes of different databases on one server apart.
    """
    return f"{purpose}:{connections[using].settings_dict['NAME']}"[:64]
