"""`short_transaction`: the worker's claim and acknowledgement transactions in the fewest round trips.

On MySQL and MariaDB it is ``START TRANSACTION`` ... ``COMMIT`` with
Django's own state set as ``atomic()`` sets it; elsewhere it is
``atomic()``. What code inside relies on holds on every database:
``on_commit`` hooks run after the commit only, ``select_for_update`` and a
nested ``atomic()`` work, an error rolls everything back, and the
connection is in autocommit again afterwards.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

import django_dbqueue
from django_dbqueue.db.transactions import short_transaction
from django_dbqueue.models import Message

pytestmark = pytest.mark.django_db(transaction=True)

Q = "txn"


class Boom(Exception):
    pass


def test_on_commit_hooks_run_once_after_the_commit_and_never_after_a_rollback():
    ran: list[str] = []
    with short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 1})
        transaction.on_commit(lambda: ran.append("committed"))
        assert ran == []
    assert ran == ["committed"]
    with pytest.raises(Boom), short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 2})
        transaction.on_commit(lambda: ran.append("rolled back"))
        raise Boom
    assert ran == ["committed"]
    assert [m.payload for m in Message.objects.all()] == [{"n": 1}]
    assert connection.get_autocommit() and not connection.in_atomic_block


def test_select_for_update_and_a_nested_atomic_work_inside():
    first = django_dbqueue.enqueue(Q, {"n": 1})
    with short_transaction("default"):
        locked = list(Message.objects.select_for_update().filter(pk=first.pk))
        assert [m.pk for m in locked] == [first.pk]
        with pytest.raises(Boom), transaction.atomic():
            django_dbqueue.enqueue(Q, {"n": "inner"})
            raise Boom  # back to the savepoint: the outer transaction goes on
        django_dbqueue.enqueue(Q, {"n": 2})
    assert sorted(m.payload["n"] for m in Message.objects.all()) == [1, 2]


def test_what_it_wrote_is_committed_for_other_connections_and_autocommit_is_back():
    with short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 1})
    # Another connection sees the row: the COMMIT was sent, not left to a later statement.
    other = connection.copy()
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM dbqueue_message")
            assert cursor.fetchone()[0] == 1
    finally:
        other.close()
    django_dbqueue.enqueue(Q, {"n": 2})  # in autocommit again: committed at once
    assert connection.get_autocommit()


def test_on_mysql_no_set_autocommit_is_sent():
    """The point of it: ``atomic()`` sends ``SET autocommit`` twice per transaction; this sends none."""
    if connection.vendor != "mysql":
        pytest.skip("MySQL and MariaDB answer SET autocommit; the others switch it in the driver")
    connection.ensure_connection()

    def set_statements() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Com_set_option'")
            return int(cursor.fetchone()[1])

    before = set_statements()
    with short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 1})
        transaction.on_commit(lambda: None)
    assert set_statements() == before
    with transaction.atomic():
        django_dbqueue.enqueue(Q, {"n": 2})
    assert set_statements() == before + 2  # what atomic() costs, for the comparison


mysql_only = pytest.mark.skipif(
    "connection.vendor != 'mysql'", reason="elsewhere short_transaction is Django's atomic(), tested by Django"
)


@mysql_only
def test_a_failed_commit_rolls_back_runs_no_hook_and_leaves_the_connection_usable(monkeypatch):
    """Fault: the COMMIT fails (refused by the server, as a deadlock's victim is)."""
    from django.db import OperationalError

    ran: list[str] = []

    def refused():
        raise OperationalError(1213, "Deadlock found when trying to get lock")

    with pytest.raises(OperationalError), short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 1})
        transaction.on_commit(lambda: ran.append("hook"))
        monkeypatch.setattr(connection, "commit", refused)
    monkeypatch.undo()
    assert ran == [] and not Message.objects.exists()
    assert connection.get_autocommit() and not connection.in_atomic_block
    django_dbqueue.enqueue(Q, {"n": 2})
    assert Message.objects.count() == 1


@mysql_only
def test_a_transaction_closed_or_marked_for_rollback_inside_is_not_committed():
    for spoil, why in ((connection.close, "closed"), (lambda: transaction.set_rollback(True), "marked for a rollback")):
        ran: list[str] = []
        with pytest.raises(transaction.TransactionManagementError, match=why), short_transaction("default"):
            django_dbqueue.enqueue(Q, {"n": why})
            transaction.on_commit(lambda: ran.append("hook"))  # noqa: B023
            spoil()
        assert ran == []
        assert not connection.in_atomic_block and connection.get_autocommit()
        assert not Message.objects.exists()  # the connection works again, and nothing was committed


@mysql_only
def test_a_hook_that_raises_is_logged_and_the_others_still_run(caplog):
    ran: list[str] = []

    def broken():
        raise RuntimeError("hook failed")

    with short_transaction("default"):
        django_dbqueue.enqueue(Q, {"n": 1})
        transaction.on_commit(broken)
        transaction.on_commit(lambda: ran.append("after"))
    assert ran == ["after"]
    assert "on_commit hook" in caplog.text and "hook failed" in caplog.text
    assert Message.objects.count() == 1
