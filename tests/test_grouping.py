"""Statements held back and sent together (django_dbqueue.db.cursors.grouping): fewer round trips, same effects.

Every test checks what the old one-statement-at-a-time code guaranteed: the
statements run in the order written, an answer refused stops what follows
it, nothing held back escapes a transaction that rolls back, and whatever
fails on the way the connection stays in step with the server (or is
closed). The round trips are counted at the driver's cursor.
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

import django_dbqueue
from django_dbqueue import Step, Workflow
from django_dbqueue.db import cursors
from django_dbqueue.db.capabilities import statement_bytes
from django_dbqueue.db.transactions import short_transaction
from django_dbqueue.models import ArchivedMessage, Message, WorkflowStep, finishing
from django_dbqueue.workflows import chain

pytestmark = pytest.mark.django_db(transaction=True)

Q = "grouping"
TABLE = "dbqueue_grouping_probe"

groups_here = pytest.mark.skipif(
    "connection.vendor == 'sqlite'", reason="sqlite3 runs one statement per call: there each runs at once"
)
mysql_only = pytest.mark.skipif("connection.vendor != 'mysql'", reason="MySQLdb's own answers")
begins_itself = pytest.mark.skipif(
    "connection.vendor == 'sqlite'",
    reason="short_transaction begins its own transaction on MySQL and on psycopg 3; on SQLite Django's atomic()",
)


@pytest.fixture
def probe():
    """A table of (id, v) rows, made and dropped outside the test's transactions."""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cursor.execute(f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, v VARCHAR(20) NOT NULL)")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {TABLE}")


def rows():
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, v FROM {TABLE} ORDER BY id")
        return [tuple(row) for row in cursor.fetchall()]


@pytest.fixture
def trips(monkeypatch):
    """The queries the driver sent, one entry per round trip (several statements in one are one entry),
    and "commit" for the driver's own COMMIT."""
    sent: list[str] = []
    connection.ensure_connection()
    statement_bytes("default")  # MySQL's packet limit, read once per connection, before counting
    if connection.vendor == "mysql":
        from django.db.backends.mysql.base import CursorWrapper as cursor_class
    elif connection.vendor == "postgresql":
        import psycopg

        cursor_class = psycopg.ClientCursor
    else:
        pytest.skip("counted on the servers' drivers")
    execute = cursor_class.execute

    def counted(self, query, *args, **kwargs):
        sent.append(query if isinstance(query, str) else str(query))
        return execute(self, query, *args, **kwargs)

    driver = type(connection.connection)
    commit = driver.commit

    def committed(self):
        sent.append("commit")
        return commit(self)

    monkeypatch.setattr(cursor_class, "execute", counted)
    monkeypatch.setattr(driver, "commit", committed)
    return sent


def rowcount(cursor):
    return cursor.rowcount


def later_insert(key, value):
    return cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [key, value], rowcount)


@groups_here
def test_held_statements_go_out_with_the_next_answered_one_in_one_round_trip_in_order(probe, trips):
    with transaction.atomic(), cursors.grouping("default"):
        first = later_insert(1, "a")
        second = cursors.later("default", f"UPDATE {TABLE} SET v = %s WHERE id = %s", ["b%", 1], rowcount)
        assert not trips and not first.done  # nothing sent yet
        seen = cursors.run("default", f"SELECT v FROM {TABLE} WHERE id = %s", [1], lambda c: c.fetchall())
        assert [tuple(r) for r in seen] == [("b%",)]  # the UPDATE ran before the SELECT
        assert (first.get(), second.get()) == (1, 1)
        assert len([q for q in trips if q != "commit"]) == 1
    assert rows() == [(1, "b%")]


@groups_here
def test_a_statement_without_parameters_keeps_its_percent_signs(probe):
    with transaction.atomic(), cursors.grouping("default"):
        later_insert(1, "a")
        cursors.later("default", f"UPDATE {TABLE} SET v = 'x%' WHERE id = 1", None)
    assert rows() == [(1, "x%")]


@groups_here
def test_any_other_statement_sends_what_waits_first(probe, trips):
    """The ORM's statements, and Django's savepoints, go through Django's cursor: what waits goes before them."""
    with transaction.atomic(), cursors.grouping("default"):
        inserted = later_insert(1, "a")
        with connection.cursor() as cursor:  # as the ORM does
            cursor.execute(f"SELECT COUNT(*) FROM {TABLE}")
            assert cursor.fetchone()[0] == 1
        assert inserted.done and inserted.get() == 1
        later_insert(2, "b")
        assert len(connection.execute_wrappers) == 1  # the guard, while the second waits
        with transaction.atomic():  # a SAVEPOINT: the second goes before it
            later_insert(3, "c")
    assert rows() == [(1, "a"), (2, "b"), (3, "c")]
    assert connection.execute_wrappers == []


@groups_here
def test_a_refused_statement_stops_those_after_it_and_the_transaction_rolls_back(probe):
    later_insert(1, "a")  # outside a grouping block: at once
    with pytest.raises(IntegrityError), transaction.atomic(), cursors.grouping("default"):
        before = later_insert(2, "b")
        refused = later_insert(1, "dup")
        after = cursors.later("default", f"UPDATE {TABLE} SET v = 'z'", [], rowcount)
        cursors.flush(connection)
    assert isinstance(refused.error, IntegrityError)
    # MySQL tells which statement it refused, PostgreSQL does not: there every one answers with the refusal
    if connection.vendor == "mysql":
        assert before.get() == 1
        with pytest.raises(cursors.NotRun):
            after.get()
    else:
        with pytest.raises(IntegrityError):
            after.get()
    assert rows() == [(1, "a")]  # rolled back, and the connection answers


@groups_here
def test_an_answer_its_read_refuses_is_raised_once_every_answer_is_read(probe):
    class Moved(Exception):
        pass

    def refuse(cursor):
        raise Moved(f"{cursor.rowcount} rows")

    with pytest.raises(Moved), transaction.atomic(), cursors.grouping("default"):
        later_insert(1, "a")
        checked = cursors.later("default", f"UPDATE {TABLE} SET v = 'b' WHERE id = 1", [], refuse)
        after = later_insert(2, "c")
        cursors.flush(connection)
    assert checked.done and after.done and after.get() == 1  # it ran: its answer was read, in step
    assert rows() == []  # and the block rolled back


@groups_here
def test_statements_still_waiting_when_the_block_fails_are_never_sent(probe, trips):
    with pytest.raises(ZeroDivisionError), transaction.atomic(), cursors.grouping("default"):
        held = later_insert(1, "a")
        1 / 0  # noqa: B018
    assert not [q for q in trips if TABLE in q]
    with pytest.raises(cursors.NotRun):
        held.get()
    assert rows() == [] and connection.execute_wrappers == []


@groups_here
def test_what_waits_at_the_end_of_the_block_goes_out_then(probe, trips):
    with transaction.atomic(), cursors.grouping("default"):
        later_insert(1, "a")
        later_insert(2, "b")
    assert len([q for q in trips if TABLE in q]) == 1
    assert rows() == [(1, "a"), (2, "b")]


@pytest.mark.skipif("connection.vendor != 'mysql'", reason="only MySQL's answers are read one by one off the wire")
def test_an_interruption_mid_answer_closes_the_connection_instead_of_reading_out_of_step(probe):
    def interrupted(cursor):
        raise KeyboardInterrupt

    with transaction.atomic():
        with pytest.raises(KeyboardInterrupt), cursors.grouping("default"):
            later_insert(1, "a")
            cursors.later("default", f"UPDATE {TABLE} SET v = 'b' WHERE id = 1", [], interrupted)
            later_insert(2, "c")  # its answer never read
            cursors.flush(connection)
        with pytest.raises(TransactionManagementError) as raised:  # the block is over: its connection is gone
            later_insert(3, "d")
        assert isinstance(raised.value.__cause__, KeyboardInterrupt)
    assert rows() == []  # a new connection, in step; nothing committed
    later_insert(4, "e")
    assert rows() == [(4, "e")]


def test_a_watched_connection_runs_each_statement_at_once_where_it_is_seen(probe):
    with CaptureQueriesContext(connection) as seen, transaction.atomic(), cursors.grouping("default"):
        first = later_insert(1, "a")
        assert first.done and first.get() == 1
        later_insert(2, "b")
    assert len([q for q in seen.captured_queries if TABLE in q["sql"]]) == 2
    assert rows() == [(1, "a"), (2, "b")]


@pytest.mark.skipif("connection.vendor != 'sqlite'", reason="SQLite's own case")
def test_on_sqlite_each_statement_runs_at_once(probe):
    with transaction.atomic(), cursors.grouping("default"):
        assert later_insert(1, "a").done
    assert rows() == [(1, "a")]


# --- short_transaction's COMMIT --------------------------------------------------------------------


@begins_itself
def test_the_commit_goes_out_with_statements_whose_answers_nobody_reads(probe, trips):
    ran: list[str] = []
    with short_transaction("default"):
        cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [1, "a"])
        transaction.on_commit(lambda: ran.append("hook"))
    assert len(trips) == 1 and trips[0].startswith("START TRANSACTION") and trips[0].endswith("COMMIT")
    assert ran == ["hook"] and rows() == [(1, "a")]
    assert connection.get_autocommit() and not connection.in_atomic_block


@begins_itself
def test_a_statement_refused_before_the_commit_stops_it(probe):
    later_insert(1, "a")
    ran: list[str] = []
    with pytest.raises(IntegrityError), short_transaction("default"):
        cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [2, "b"])
        cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [1, "dup"])
        transaction.on_commit(lambda: ran.append("hook"))
    assert ran == [] and rows() == [(1, "a")]  # rolled back: the COMMIT after the refusal never ran
    assert connection.get_autocommit() and not connection.in_atomic_block


@begins_itself
def test_an_answer_someone_reads_goes_before_the_commit_not_with_it(probe, trips):
    """A read may refuse its answer (a lease that moved): the COMMIT must not have run by then."""
    with short_transaction("default"):
        later_insert(1, "a")
    assert len(trips) == 2 and trips[1] == "commit"


@mysql_only
def test_a_commit_whose_reply_is_lost_closes_the_connection_and_raises(probe, monkeypatch):
    """Fault: the server ran the INSERT and the COMMIT sent with it, and the connection broke before the
    COMMIT's answer was read: the connection is closed (its state is unknown), the error raised."""
    import MySQLdb
    from django.db.backends.mysql.base import CursorWrapper as MySQLCursor

    def lost(self):  # Django's MySQL cursor hands nextset() to MySQLdb's
        self.cursor.nextset()  # the COMMIT's answer, read and lost
        raise MySQLdb.OperationalError(2013, "Lost connection to server during query")

    connection.ensure_connection()
    before = connection.connection
    monkeypatch.setattr(MySQLCursor, "nextset", lost, raising=False)
    with pytest.raises(DatabaseError, match="Lost connection"), short_transaction("default"):
        cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [1, "a"])
    monkeypatch.undo()
    assert connection.connection is not before  # closed, not trusted
    assert rows() == [(1, "a")]  # it had committed: the caller finds out as after any lost reply
    assert connection.get_autocommit() and not connection.in_atomic_block


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="psycopg's answers")
def test_a_commit_whose_reply_is_lost_on_postgresql_closes_the_connection_and_raises(probe, monkeypatch):
    """Fault: the server ran the INSERT and the COMMIT sent with it, and the connection broke before psycopg
    had the answers: the connection is closed (its state is unknown), the error raised, the work committed."""
    import psycopg

    execute = psycopg.ClientCursor.execute

    def lost(self, query, *args, **kwargs):
        result = execute(self, query, *args, **kwargs)
        if str(query).endswith("COMMIT"):
            self.connection.pgconn.finish()  # the socket is gone once the server has answered
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return result

    connection.ensure_connection()
    before = connection.connection
    monkeypatch.setattr(psycopg.ClientCursor, "execute", lost)
    with pytest.raises(DatabaseError, match="closed the connection"), short_transaction("default"):
        cursors.later("default", f"INSERT INTO {TABLE} (id, v) VALUES (%s, %s)", [1, "a"])
    monkeypatch.undo()
    assert connection.connection is not before  # closed, not trusted
    assert rows() == [(1, "a")]  # it had committed: the caller finds out as after any lost reply
    assert connection.get_autocommit() and not connection.in_atomic_block


@begins_itself
def test_a_held_statement_refused_where_other_code_catches_its_own_errors_stops_the_commit(probe):
    """A held INSERT is refused when an unrelated savepoint sends it; the code around the savepoint takes the
    IntegrityError for its own and goes on. The transaction must not commit without the refused work."""
    later_insert(1, "a")
    ran: list[str] = []
    with pytest.raises(TransactionManagementError), short_transaction("default"):
        later_insert(2, "b")
        later_insert(1, "dup")  # refused when it goes out
        try:
            with transaction.atomic():  # its SAVEPOINT sends what waits first
                pass
        except IntegrityError:
            pass  # "mine": a handler that expects a duplicate key of its own
        transaction.on_commit(lambda: ran.append("hook"))
    assert ran == [] and rows() == [(1, "a")]


@groups_here
def test_a_wrapper_the_block_adds_and_takes_off_leaves_the_guard_in_place(probe):
    """Django's execute_wrapper() takes off the last wrapper: the guard sits under any the block adds."""
    seen: list[str] = []

    def watch(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with transaction.atomic(), cursors.grouping("default"):
        with connection.execute_wrapper(watch):
            later_insert(1, "a")  # watched: at once, and seen
        later_insert(2, "b")  # held again
        with connection.cursor() as cursor:  # the guard still sends it first
            cursor.execute(f"SELECT COUNT(*) FROM {TABLE}")
            assert cursor.fetchone()[0] == 2
    assert connection.execute_wrappers == []
    assert [q for q in seen if TABLE in q] == [seen[0]] and "INSERT" in seen[0]


@groups_here
def test_statements_past_half_the_servers_packet_limit_go_in_more_round_trips(probe, trips, monkeypatch):
    monkeypatch.setattr(cursors, "statement_bytes", lambda using: 1000)  # 500 bytes a query
    with transaction.atomic(), cursors.grouping("default"):
        for n in range(6):
            later_insert(n, "x" * 10)  # about 110 bytes each: four to a query
    assert len([q for q in trips if TABLE in q]) == 2
    assert [r[0] for r in rows()] == list(range(6))


@groups_here
def test_mysqlclient_told_not_to_take_several_statements_gets_them_one_by_one(probe, trips):
    if connection.vendor != "mysql":
        pytest.skip("mysqlclient's option")
    options = connection.settings_dict["OPTIONS"]
    connection.close()
    options["multi_statements"] = False
    try:
        with short_transaction("default"):
            later_insert(1, "a")
            later_insert(2, "b")
        django_dbqueue.enqueue(Q, {"n": 1})
        assert len(Message.objects.claim([Q], worker="w")) == 1
    finally:
        del options["multi_statements"]
        connection.close()
    assert rows() == [(1, "a"), (2, "b")]
    assert not any(";" in q for q in trips)


def test_grouping_outside_a_transaction_is_refused():
    with pytest.raises(TransactionManagementError), cursors.grouping("default"):
        pass


# --- the paths that use it -----------------------------------------------------------------------


@groups_here
def test_a_chain_steps_ack_and_claim_take_five_round_trips(trips):
    """Eleven on MySQL, nine on PostgreSQL, one statement at a time (docs/benchmarks.md). On both the
    transaction's START TRANSACTION goes out with the ack's first statement: psycopg sends no BEGIN."""
    run = chain("trips", *(Step(f"s{n}", Q, {"n": n}) for n in range(3))).enqueue()
    [first] = Message.objects.claim([Q], worker="w")
    trips.clear()
    answers, taken = Message.objects.ack_then_claim([first], [Q], 1, worker="w")
    assert answers == [True] and [m.headers["dbqueue_step"][1] for m in taken] == ["s1"]
    assert len(trips) == 5, trips
    step = WorkflowStep.objects.get(workflow=run, name="s1")
    assert (step.state, step.message_id) == ("enqueued", taken[0].pk)


@groups_here
def test_a_plain_ack_and_claim_take_two_round_trips_each_on_mysql(trips):
    django_dbqueue.enqueue_many(Q, [{"n": 1}, {"n": 2}])
    trips.clear()
    claimed = Message.objects.claim([Q], limit=2, worker="w")
    claim_trips = len(trips)
    trips.clear()
    assert Message.objects.ack_many(claimed, worker="w") == [True, True]
    if connection.vendor == "mysql":
        assert (claim_trips, len(trips)) == (2, 2)  # four and four, one statement at a time
    else:
        assert (claim_trips, len(trips)) == (1, 1)  # one statement each, in autocommit
    assert ArchivedMessage.objects.count() == 2 and not Message.objects.exists()


@pytest.mark.parametrize("lost", ["first", "second"])
def test_a_batch_of_steps_whose_lease_moved_settles_only_the_steps_it_acked(lost, monkeypatch):
    """The steps' statements go out with the ack's, as if every lease held: one that did not sends the
    transaction back, and the acks are written again by the lock (MySQL) or by what the ack deleted
    (PostgreSQL); the step whose message was taken from the worker stays enqueued, its child waiting."""
    refused: list[str] = []
    real = finishing._LeaseMoved

    class Moved(real):  # counts the refusals of the speculative round trip
        def __init__(self, *args):
            refused.append(str(args))
            super().__init__(*args)

    monkeypatch.setattr(finishing, "_LeaseMoved", Moved)
    workflow = Workflow("moved")
    workflow.add("a", Q, {})
    workflow.add("b", Q, {})
    workflow.add("a2", Q, {}, after=["a"])
    workflow.add("b2", Q, {}, after=["b"])
    run = workflow.enqueue()
    claimed = sorted(Message.objects.claim([Q], limit=2, worker="w"), key=lambda m: m.headers["dbqueue_step"][1])
    taken = claimed[0] if lost == "first" else claimed[1]
    Message.objects.filter(pk=taken.pk).update(lease_token="someone-else")
    answers = Message.objects.ack_many(claimed, worker="w")
    assert answers == [m is not taken for m in claimed]
    assert refused  # the first try was refused; the second went by the lock, or by the ack's answer
    states = dict(WorkflowStep.objects.filter(workflow=run).values_list("name", "state"))
    kept_name = "b" if lost == "first" else "a"
    lost_name = "a" if lost == "first" else "b"
    assert states[kept_name] == "acked" and states[kept_name + "2"] == "enqueued"
    assert states[lost_name] == "enqueued" and states[lost_name + "2"] == "waiting"
    assert ArchivedMessage.objects.count() == 1
    assert connections["default"].execute_wrappers == []
