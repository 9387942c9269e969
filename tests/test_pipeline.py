"""enqueue_many's statements in flight (django_dbqueue.db.cursors.Pipeline): the messages of one statement are
made while the server runs it, and whatever fails on the way, nothing is written and the connection stays in step."""

import contextlib

import hypothesis
import pytest
from django.db import DatabaseError, IntegrityError, connection, connections, transaction
from django.db.transaction import TransactionManagementError
from django.test import override_settings
from hypothesis import strategies as st

import django_dbqueue
from django_dbqueue import propagation
from django_dbqueue.conf import get_settings
from django_dbqueue.db import cursors
from django_dbqueue.exceptions import PayloadNotSerializable
from django_dbqueue.models import Message
from tests.support.machines import PROFILE

pytestmark = pytest.mark.django_db(transaction=True)

mysql_only = pytest.mark.skipif(
    "connection.vendor != 'mysql'",
    reason="only MySQLdb sends a statement and reads its answer later; elsewhere each runs at once",
)


def many(count, **marks):
    """``count`` payloads; ``marks`` puts a value at an index: {700: object()}."""
    return [marks.get(str(i), {"n": i}) for i in range(count)]


def still_in_step():
    """The connection answers a new statement (no "commands out of sync"), and nothing was written."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone()[0] == 1
    assert Message.objects.count() == 0
    django_dbqueue.enqueue_many("jobs", [{"after": 1}, {"after": 2}])
    assert sorted(m["after"] for m in Message.objects.values_list("payload", flat=True)) == [1, 2]


def test_more_messages_than_one_statement_come_back_in_order_with_their_ids():
    count = 2 * get_settings().enqueue_batch_size + 200  # three statements
    messages = django_dbqueue.enqueue_many("jobs", many(count), headers={"h": 1})
    stored = list(Message.objects.order_by("pk").values_list("pk", "payload", "headers"))
    assert [(m.pk, m.payload, m.headers) for m in messages] == stored
    assert [p["n"] for _, p, _ in stored] == list(range(count))
    assert all(m.was_created and not m._state.adding and m._state.db == "default" for m in messages)
    messages[5].headers["h"] = 2  # each message its own headers
    assert messages[6].headers == {"h": 1}


@mysql_only
def test_the_messages_of_a_statement_are_made_while_the_server_runs_it(monkeypatch):
    events = []
    django_dbqueue.enqueue("jobs", {})  # the connection open
    driver = type(connections["default"].connection)  # MySQLdb's Connection, a Python class over _mysql's
    send, read = driver.send_query, driver.read_query_result

    def sent(self, query):
        events.append("send")
        return send(self, query)

    def answered(self):
        events.append("read")
        return read(self)

    made = Message.with_payload

    def copy(self, payload, headers, text=None):
        events.append("make")
        return made(self, payload, headers, text)

    monkeypatch.setattr(driver, "send_query", sent)
    monkeypatch.setattr(driver, "read_query_result", answered)
    monkeypatch.setattr(Message, "with_payload", copy)
    batch = get_settings().enqueue_batch_size
    messages = django_dbqueue.enqueue_many("jobs", many(2 * batch + 10))
    runs = [event for i, event in enumerate(events) if i == 0 or events[i - 1] != event]
    # One copy of the first message is made before anything is sent; then each statement is sent, its
    # messages made, and only then its answer read.
    assert runs == ["make", "send", "make", "read", "send", "make", "read", "send", "make", "read"]
    assert events.count("make") == 1 + 2 * batch + 9
    assert len({m.pk for m in messages}) == 2 * batch + 10 == Message.objects.filter(queue="jobs").count() - 1


def test_a_payload_refused_after_a_statement_was_sent_leaves_nothing_written():
    batch = get_settings().enqueue_batch_size
    with pytest.raises(PayloadNotSerializable):
        django_dbqueue.enqueue_many("jobs", many(3 * batch, **{str(batch + 100): {"x": object()}}))
    still_in_step()


def test_inside_a_transaction_the_refused_call_is_undone_and_the_rest_kept():
    batch = get_settings().enqueue_batch_size
    with transaction.atomic():
        kept = django_dbqueue.enqueue("jobs", {"kept": True})
        with pytest.raises(PayloadNotSerializable):
            django_dbqueue.enqueue_many("jobs", many(3 * batch, **{str(2 * batch + 1): {1j}}))
        django_dbqueue.enqueue("jobs", {"kept": "too"})
    assert sorted(Message.objects.values_list("payload", flat=True), key=str) == [{"kept": "too"}, {"kept": True}]
    assert Message.objects.filter(pk=kept.pk).exists()


def test_header_hooks_run_once_per_message_and_may_use_the_database():
    # Hooks are user code: they run before any statement is in flight, so a query of theirs gets its own answer.
    calls = []

    def hook(queue, kind, headers):
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s", [len(calls)])
            calls.append(cursor.fetchone()[0])
        return {**headers, "trace": calls[-1]}

    count = 2 * get_settings().enqueue_batch_size + 3
    propagation.add(hook)
    try:
        messages = django_dbqueue.enqueue_many("jobs", many(count))
    finally:
        propagation.remove(hook)
    assert calls == list(range(count))
    stored = list(Message.objects.order_by("pk").values_list("pk", "headers"))
    assert [(m.pk, m.headers) for m in messages] == stored == [(m.pk, {"trace": i}) for i, m in enumerate(messages)]


def test_a_header_hook_that_raises_midway_leaves_nothing_written():
    batch, calls = get_settings().enqueue_batch_size, []

    def hook(queue, kind, headers):
        calls.append(1)
        if len(calls) == batch + 50:  # hooks run before any statement: nothing is sent
            raise RuntimeError("the tracer broke")
        return {**headers, "trace": len(calls)}

    propagation.add(hook)
    try:
        with pytest.raises(RuntimeError, match="the tracer broke"):
            django_dbqueue.enqueue_many("jobs", many(2 * batch))
    finally:
        propagation.remove(hook)
    still_in_step()


@pytest.fixture
def refusing_trigger():
    """A trigger that refuses a row whose payload holds "boom" (SIGNAL) and nulls the kind of one holding "null"."""
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS dbqueue_test_refuse")
        cursor.execute(
            "CREATE TRIGGER dbqueue_test_refuse BEFORE INSERT ON dbqueue_message FOR EACH ROW BEGIN "
            "IF JSON_EXTRACT(NEW.payload, '$.boom') IS NOT NULL THEN "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'boom refused'; END IF; "
            "IF JSON_EXTRACT(NEW.payload, '$.null') IS NOT NULL THEN SET NEW.kind = NULL; END IF; END"
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS dbqueue_test_refuse")


@mysql_only
@pytest.mark.parametrize(("mark", "error"), [("boom", DatabaseError), ("null", IntegrityError)])
def test_a_statement_the_server_refuses_in_flight_raises_djangos_error(refusing_trigger, mark, error):
    batch = get_settings().enqueue_batch_size
    with pytest.raises(error) as raised:
        django_dbqueue.enqueue_many("jobs", many(3 * batch, **{str(batch + 7): {mark: 1}}))
    assert type(raised.value).__module__ == "django.db.utils" and raised.value.__cause__ is not None
    assert raised.value.__cause__.__cause__ is not raised.value.__cause__  # no error its own cause
    if mark == "boom":
        assert "boom refused" in str(raised.value)
    still_in_step()


@mysql_only
def test_a_refusal_read_on_the_way_out_keeps_the_callers_transaction(refusing_trigger):
    # A payload refused while the statement in flight is refused by the server too: the caller sees the
    # payload's error, the server's answer is read (not left on the wire), and the connection, in step,
    # stays open: the caller's transaction goes on.
    batch = get_settings().enqueue_batch_size
    before = connections["default"].connection
    with transaction.atomic():
        kept = django_dbqueue.enqueue("jobs", {"kept": True})
        payloads = many(3 * batch, **{str(batch + 7): {"boom": 1}, str(2 * batch + 1): {1j}})
        with pytest.raises(PayloadNotSerializable):
            django_dbqueue.enqueue_many("jobs", payloads)
        django_dbqueue.enqueue("jobs", {"kept": "too"})
    assert connections["default"].connection is before
    assert sorted(Message.objects.values_list("payload", flat=True), key=str) == [{"kept": "too"}, {"kept": True}]
    assert Message.objects.filter(pk=kept.pk).exists()


def test_an_execute_wrapper_sees_every_statement_of_enqueue_many():
    seen = []

    def watch(execute, sql, params, many_, context):
        seen.append(sql)
        return execute(sql, params, many_, context)

    batch = get_settings().enqueue_batch_size
    with connection.execute_wrapper(watch):
        django_dbqueue.enqueue_many("jobs", many(2 * batch + 1))
    assert sum(sql.startswith("INSERT INTO") for sql in seen) >= 3
    assert Message.objects.count() == 2 * batch + 1


def test_one_statement_in_flight_at_a_time():
    django_dbqueue.enqueue("jobs", {})
    with cursors.Pipeline("default") as pipeline:
        with pytest.raises(RuntimeError, match="no statement was sent"):
            pipeline.take()
        pipeline.send("SELECT 1", [])
        with pytest.raises(RuntimeError, match="answer was not taken"):
            pipeline.send("SELECT 2", [])
        assert [tuple(row) for row in pipeline.take()] == [(1,)]
        pipeline.send("SELECT 3", [])  # left for the block's end to read
    with connection.cursor() as cursor:
        cursor.execute("SELECT 4")
        assert cursor.fetchone()[0] == 4


class Interrupted(BaseException):
    """As KeyboardInterrupt or a timeout's SystemExit would: raised as the driver's C call returns."""


class Broken(Exception):
    """An ordinary error of the caller's side (a payload's check, a bug)."""


@contextlib.contextmanager
def interrupted_at(where):
    """The driver's calls (and the making of messages) raise as ``where`` plans, from the pipeline's first
    statement on: ``"read_query_result:after"`` raises Interrupted once that call has done its work,
    ``"send_query:before"`` before it starts, ``"with_payload:broken"`` raises Broken there. Yields the
    list of what was raised; a read timeout on the connection turns a regression that waits on the
    socket into a failure."""
    wrapper = connections["default"]
    planned, done, armed = list(where), [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(wrapper.settings_dict["OPTIONS"], "read_timeout", 30)
        wrapper.close()
        wrapper.ensure_connection()

        def interrupting(owner, name):
            original = getattr(owner, name)

            def call(self, *args):
                if name == "send_query":
                    armed.append(name)
                for when, error in (("before", Interrupted), ("broken", Broken)):
                    if armed and planned and planned[0] == f"{name}:{when}":
                        done.append(planned.pop(0))
                        raise error
                result = original(self, *args)
                if armed and planned and planned[0] == f"{name}:after":
                    done.append(planned.pop(0))
                    raise Interrupted
                return result

            patch.setattr(owner, name, call)

        for name in ("send_query", "read_query_result", "store_result"):
            interrupting(type(wrapper.connection), name)
        interrupting(Message, "with_payload")
        try:
            yield done
        finally:
            patch.undo()
            wrapper.close()  # the next test's connection without the read timeout
    assert done == where


def answers_its_own():
    """Every statement gets its own answer, not the INSERT's ids."""
    for n in range(3):
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s", [n + 10])
            assert cursor.fetchall() == ((n + 10,),)


@mysql_only
@pytest.mark.parametrize(
    ("where", "kept", "raised"),
    [
        # Making a message while the statement is out: nothing read yet, the answer is read, the connection kept.
        (["with_payload:before"], True, Interrupted),
        # In the driver's calls, as they return: what is left on the wire is unknown, the connection is closed.
        (["send_query:before"], False, Interrupted),
        (["send_query:after"], False, Interrupted),
        (["read_query_result:after"], False, Interrupted),
        (["store_result:after"], False, Interrupted),
        # The read on leaving the block interrupted too: that interruption is the one the caller sees.
        (["with_payload:before", "read_query_result:after"], False, Interrupted),
        (["with_payload:broken", "read_query_result:after"], False, Interrupted),
        # A plain error while the statement is out: the answer is read, the connection kept.
        (["with_payload:broken"], True, Broken),
    ],
)
def test_an_interruption_in_flight_never_leaves_the_connection_out_of_step(where, kept, raised):
    django_dbqueue.enqueue("jobs", {})
    Message.objects.all().delete()
    with interrupted_at(where):
        before = connections["default"].connection
        with pytest.raises(raised):
            django_dbqueue.enqueue_many("jobs", many(2 * get_settings().enqueue_batch_size))
        answers_its_own()  # on the same connection where the answer could be read, else on a new one
        assert (connections["default"].connection is before) == kept
    still_in_step()


@mysql_only
def test_an_interruption_inside_the_callers_transaction_ends_it():
    with interrupted_at(["read_query_result:after"]):
        with transaction.atomic():
            django_dbqueue.enqueue("jobs", {"lost": True})
            with pytest.raises(Interrupted):
                django_dbqueue.enqueue_many("jobs", many(2 * get_settings().enqueue_batch_size))
            with pytest.raises(TransactionManagementError) as refused:
                django_dbqueue.enqueue("jobs", {"refused": True})
            assert isinstance(refused.value.__cause__, Interrupted)
        answers_its_own()
    still_in_step()  # nothing of the block was committed


@mysql_only
def test_a_tracers_proxy_or_a_measuring_backend_is_not_sent_statements_to_read_later(monkeypatch):
    django_dbqueue.enqueue("jobs", {})
    wrapper = connections["default"]
    assert cursors.Pipeline("default").driver is wrapper.connection

    class Proxy:  # as a tracer's instrumentation wraps the driver's connection
        def __init__(self, wrapped):
            self.wrapped = wrapped

        def __getattr__(self, name):
            return getattr(self.wrapped, name)

    real = wrapper.connection
    monkeypatch.setattr(wrapper, "connection", Proxy(real))
    assert cursors.Pipeline("default").driver is None
    monkeypatch.setattr(wrapper, "connection", real)

    class Measuring(type(wrapper)):  # as a backend that counts statements in its cursors does
        def create_cursor(self, name=None):
            return super().create_cursor(name)

    monkeypatch.setattr(wrapper, "__class__", Measuring)
    assert cursors.Pipeline("default").driver is None


# The net under the chunking: any number of payloads, any statement size, a bad payload anywhere or none,
# with or without hooks and headers, against what docs/api.md says enqueue_many does.
@hypothesis.given(
    count=st.integers(1, 40),
    batch=st.integers(1, 9),
    bad=st.one_of(st.none(), st.integers(0, 39)),
    hooked=st.booleans(),
    headers=st.sampled_from([None, {}, {"h": "x"}]),
)
@hypothesis.settings(
    max_examples=40 if PROFILE == "ci" else 400,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
def test_enqueue_many_does_what_the_docs_say_at_any_size(count, batch, bad, hooked, headers):
    Message.objects.all().delete()
    payloads = [{"x": object()} if n == bad else {"n": n} for n in range(count)]
    seen = []

    def hook(queue, kind, given):
        seen.append(len(seen))
        return {**given, "trace": seen[-1]}

    options = {} if headers is None else {"headers": headers}
    if hooked:
        propagation.add(hook)
    try:
        with override_settings(DBQUEUE={"ENQUEUE_BATCH_SIZE": batch}):
            if bad is not None and bad < count:
                with pytest.raises(PayloadNotSerializable):
                    django_dbqueue.enqueue_many("jobs", payloads, **options)
                still_in_step()
                return
            messages = django_dbqueue.enqueue_many("jobs", payloads, **options)
    finally:
        propagation.remove(hook)
    expected = [{**(headers or {}), **({"trace": n} if hooked else {})} for n in range(count)]
    assert [m.payload for m in messages] == payloads
    assert [m.headers for m in messages] == expected
    assert len({id(m.headers) for m in messages}) == count  # each its own
    assert seen == (list(range(count)) if hooked else [])
    stored = list(Message.objects.order_by("pk").values_list("pk", "payload", "headers"))
    assert [(p, h) for _, p, h in stored] == list(zip(payloads, expected, strict=True))
    if messages[0].pk is not None:  # MySQL (not MariaDB) returns no ids from a multi-row INSERT
        assert [m.pk for m in messages] == [pk for pk, _, _ in stored]
