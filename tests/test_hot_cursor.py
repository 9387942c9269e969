"""The hot path's statements on a kept driver cursor (django_dbqueue.db.cursors), and what still sees them."""

import asyncio

import pytest
from django.core.exceptions import SynchronousOnlyOperation
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

import django_dbqueue
from django_dbqueue.db import cursors
from django_dbqueue.models import Message

pytestmark = pytest.mark.django_db(transaction=True)


def kept():
    return connections["default"].__dict__.get(cursors.KEPT)  # the wrapper's, not the proxy's (connection)


def test_an_enqueue_reuses_one_driver_cursor_per_connection():
    connection.close()
    first = django_dbqueue.enqueue("jobs", {"n": 1})  # opens the connection, through connection.cursor()
    assert kept() is None or kept()[0] is not connection.connection
    second = django_dbqueue.enqueue("jobs", {"n": 2})
    cursor = kept()[1]
    third = django_dbqueue.enqueue("jobs", {"n": 3})
    assert kept()[1] is cursor and kept()[0] is connection.connection
    connection.close()  # a new connection gets a cursor of its own
    django_dbqueue.enqueue("jobs", {"n": 4})
    fifth = django_dbqueue.enqueue("jobs", {"n": 5})
    assert kept()[1] is not cursor and kept()[0] is connection.connection
    pks = list(Message.objects.order_by("pk").values_list("pk", flat=True))
    assert pks[:3] == [first.pk, second.pk, third.pk] and pks[-1] == fifth.pk and len(pks) == 5


def test_an_execute_wrapper_sees_every_enqueue():
    seen = []

    def watch(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watch):
        message = django_dbqueue.enqueue("jobs", {"n": 7})
    inserts = [(sql, params) for sql, params in seen if sql.startswith("INSERT INTO")]
    assert len(inserts) == 1 and '{"n": 7}' in inserts[0][1]
    assert Message.objects.get().pk == message.pk


def test_the_query_log_sees_every_enqueue():
    with CaptureQueriesContext(connection) as queries:
        django_dbqueue.enqueue("jobs", {"n": 1})
        django_dbqueue.enqueue("jobs", {"n": 2})
    assert sum(q["sql"].startswith("INSERT INTO") for q in queries.captured_queries) == 2


def test_errors_are_djangos_and_mark_the_connection():
    django_dbqueue.enqueue("jobs", {})  # the connection is open: the kept cursor's path
    with pytest.raises(DatabaseError) as raised:
        cursors.run("default", "SELECT * FROM no_such_table", [], lambda c: c.fetchall())
    assert type(raised.value).__module__ == "django.db.utils" and raised.value.__cause__ is not None
    assert connection.errors_occurred
    pk = Message.objects.get().pk
    with pytest.raises(IntegrityError):  # a row the table refuses (a NOT NULL column, a duplicate id), as Django's
        cursors.run("default", "INSERT INTO dbqueue_message (id) VALUES (%s)", [pk], lambda c: None)


def test_a_broken_transaction_is_refused_as_django_refuses_it():
    django_dbqueue.enqueue("jobs", {})
    with transaction.atomic():
        try:
            with transaction.atomic(savepoint=False):
                cursors.run("default", "SELECT * FROM no_such_table", [], lambda c: c.fetchall())
        except DatabaseError:
            pass
        with pytest.raises(TransactionManagementError):
            cursors.run("default", "SELECT 1", [], lambda c: c.fetchone())


def test_it_is_refused_inside_an_event_loop():
    django_dbqueue.enqueue("jobs", {})  # the connection is open: the kept cursor's path, not Django's

    async def enqueue_in_the_loop():
        return cursors.run("default", "SELECT 1", [], lambda c: c.fetchone())

    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(enqueue_in_the_loop())


def test_an_agent_that_patched_djangos_cursor_sees_every_enqueue(monkeypatch):
    # As APM agents do (Sentry's Django integration among them): CursorWrapper.execute replaced, at times
    # with functools.wraps, which makes the replacement look like Django's own but for its code.
    import functools

    from django.db.backends.utils import CursorWrapper

    seen = []
    original = CursorWrapper.execute

    @functools.wraps(original)
    def traced(self, sql, params=None):
        seen.append(sql)
        return original(self, sql, params)

    monkeypatch.setattr(CursorWrapper, "execute", traced)
    django_dbqueue.enqueue("jobs", {})
    django_dbqueue.enqueue("jobs", {})
    assert sum(sql.startswith("INSERT INTO") for sql in seen) == 2


def test_a_connection_whose_cursor_method_was_replaced_sees_every_enqueue(monkeypatch):
    # As django-debug-toolbar does, on the connection itself.
    seen = []
    wrapper = connections["default"]
    original = wrapper.cursor

    def cursor():
        seen.append("cursor")
        return original()

    django_dbqueue.enqueue("jobs", {})  # open
    monkeypatch.setattr(wrapper, "cursor", cursor, raising=False)
    django_dbqueue.enqueue("jobs", {})
    assert seen == ["cursor"]


def test_after_an_enqueue_sqlite_is_free_for_another_writer():
    # An INSERT ... RETURNING left unfinished on a kept cursor would hold SQLite's write lock.
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one write lock; the servers lock rows")
    import sqlite3

    django_dbqueue.enqueue("jobs", {})
    django_dbqueue.enqueue("jobs", {})
    assert kept() is not None
    other = sqlite3.connect(connections["default"].settings_dict["NAME"], timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # "database is locked" at once if the enqueue still held it
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_a_connection_that_threads_share_keeps_no_cursor():
    # LiveServerTestCase's threads share the test's in-memory SQLite connection: one kept cursor would
    # be used by two threads at once.
    wrapper = connections["default"]
    django_dbqueue.enqueue("jobs", {})
    wrapper.__dict__.pop(cursors.KEPT, None)
    wrapper.inc_thread_sharing()
    try:
        django_dbqueue.enqueue("jobs", {})
        assert kept() is None
    finally:
        wrapper.dec_thread_sharing()
    django_dbqueue.enqueue("jobs", {})
    assert kept() is not None
