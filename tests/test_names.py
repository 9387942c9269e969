"""Names compare exactly on every database: "Acme", "acme" and "acme " are three names (DESIGN.md, decision 9).

MySQL/MariaDB compared the identifier columns by the server's default
collation, which ignores case and trailing spaces, while Python and
PostgreSQL compare exactly; migration 0011 gives those columns a binary
NO PAD collation there. The first tests are the five bugs that
difference made; then every role of a name, in every table that stores
it; then the migration itself on an existing MySQL/MariaDB install.
"""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

import django_dbqueue
from django_dbqueue.models import (
    ArchivedMessage,
    FlowGroup,
    Message,
    QueueStat,
    QueueState,
    RateSlot,
    Schedule,
    ScheduleRun,
    Subscription,
    UniqueWindow,
    WorkflowEdge,
    WorkflowRun,
    WorkflowStep,
)
from django_dbqueue.models.flow import prune
from django_dbqueue.schedules.scheduler import Scheduler
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.factories import ArchivedMessageFactory, MessageFactory
from tests.support.schedules import Clock, at

pytestmark = pytest.mark.django_db(transaction=True)

# Three names: they differ in case, and in a trailing space.
NAMES = ("Acme", "acme", "acme ")


def claim(queue, limit=50):
    return Message.objects.claim(queue, limit)


# --- the five bugs ------------------------------------------------------------------------


def test_a_group_row_acme_neither_holds_back_group_acme_nor_stays_for_it():
    """A claim made group "Acme"'s row; group "acme" is claimed all the same, and the reaper prunes "Acme"'s row."""
    django_dbqueue.enqueue("fc-groups", {"n": "A"}, group="Acme")
    (first,) = claim("fc-groups")
    assert first.ack()
    assert list(FlowGroup.objects.values_list("name", flat=True)) == ["Acme"]
    django_dbqueue.enqueue("fc-groups", {"n": "a"}, group="acme")
    taken = claim("fc-groups")
    assert [(m.group, m.payload["n"]) for m in taken] == [("acme", "a")]
    # "Acme" has no live message any more; "acme" has one, in flight.
    assert prune("default", 100) == 1
    assert list(FlowGroup.objects.values_list("name", flat=True)) == ["acme"]


def test_a_worker_serving_emails_never_claims_queue_Emails(handler):
    seen = []
    handler("emails")(lambda message: seen.append(message.payload))
    theirs = django_dbqueue.enqueue("Emails", {"to": "them"})
    mine = django_dbqueue.enqueue("emails", {"to": "me"})
    assert QueueWorker(WorkerConfig(queues=["emails"], until_empty=True, max_runtime=60)).run() == ExitStatus.OK
    assert seen == [{"to": "me"}]
    assert ArchivedMessage.objects.get(message_id=mine.pk).outcome == "acked"
    # Not claimed, not dead-lettered for want of a handler: still waiting for a worker of its own queue.
    left = Message.objects.get(pk=theirs.pk)
    assert (left.queue, left.attempts, left.lease_token) == ("Emails", 0, None)
    assert not ArchivedMessage.objects.filter(message_id=theirs.pk).exists()


def test_keys_differing_in_case_or_a_trailing_space_are_three_keys():
    keys = ("Order-7", "order-7", "Order-7 ")
    made = [django_dbqueue.enqueue("orders", {"key": key}, key=key) for key in keys]
    assert [m.was_created for m in made] == [True, True, True]
    assert sorted(Message.objects.values_list("key", flat=True)) == sorted(keys)
    # Each key finds its own live message again, and only that one.
    again = [django_dbqueue.enqueue("orders", {"again": key}, key=key) for key in keys]
    assert [(m.was_created, m.pk, m.payload) for m in again] == [(False, m.pk, m.payload) for m in made]


def test_fifo_groups_differing_in_case_stay_two_groups():
    for group in ("Acme", "acme", "acme "):
        for n in range(2):
            django_dbqueue.enqueue("fc-fifo", {"group": group, "n": n}, group=group)
    heads = claim("fc-fifo")
    # One head per group, each its group's first.
    assert sorted((m.group, m.payload["n"]) for m in heads) == [("Acme", 0), ("acme", 0), ("acme ", 0)]
    assert claim("fc-fifo") == []


def test_publish_with_a_key_differing_only_in_case_from_a_live_messages_inserts_it():
    """publish() to two queues takes the keyed multi-row path: insert what is new, then read every key back."""
    first = django_dbqueue.publish("t-orders", {"n": 1}, key="Order-7")
    second = django_dbqueue.publish("t-orders", {"n": 2}, key="order-7")
    assert [m.was_created for m in first + second] == [True] * 4
    assert sorted(Message.objects.values_list("queue", "key")) == [
        ("t-email", "Order-7"),
        ("t-email", "order-7"),
        ("t-invoicing", "Order-7"),
        ("t-invoicing", "order-7"),
    ]


def test_schedules_Nightly_and_nightly_are_two_schedules_and_both_fire(schedules):
    """Two names, two schedules: the check accepts them, the scheduler starts and fires each on its own."""
    schedules("Nightly", every=60, queue="s-upper")
    schedules("nightly", every=60, queue="s-lower")
    from django.core import checks

    assert [e for e in checks.run_checks(databases=["default"]) if e.id.startswith("django_dbqueue.")] == []
    out = StringIO()
    call_command("runqueueschedules", "--once", stdout=out, stderr=StringIO())  # it used to stop on a KeyError
    assert sorted(Schedule.objects.values_list("name", flat=True)) == ["Nightly", "nightly"]
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    scheduler = Scheduler(clock=clock)
    Schedule.objects.all().delete()
    scheduler.run_once()
    clock.advance(31)
    report = scheduler.run_once()
    assert sorted(name for name, _ in report.fired) == ["Nightly", "nightly"]
    assert sorted(ScheduleRun.objects.values_list("schedule_id", flat=True)) == ["Nightly", "nightly"]
    assert sorted(Message.objects.values_list("queue", "headers__schedule")) == [
        ("s-lower", "nightly"),
        ("s-upper", "Nightly"),
    ]


# --- every role, in every table that stores it ----------------------------------------------


def _now():
    return timezone.now()


def _message(**fields):
    return MessageFactory(**{"queue": "names", **fields})


def _archived(**fields):
    return ArchivedMessageFactory(**{"queue": "names", **fields})


def _schedule(**fields):
    return Schedule.objects.create(**{"name": "names", "created_at": _now(), "covered_until": _now(), **fields})


def _schedule_run(schedule):
    row = _schedule(name=schedule)
    return ScheduleRun.objects.create(schedule=row, slot=_now(), trigger="scheduled", fired_at=_now())


def _stat(**fields):
    return QueueStat.objects.create(**{"hour": at(2026, 5, 1, 10), "queue": "names", **fields})


def _group(**fields):
    return FlowGroup.objects.create(**{"queue": "names", "name": "g", **fields})


def _slot(**fields):
    return RateSlot.objects.create(**{"queue": "names", "group": "", "slot": 0, "used_at": _now(), **fields})


def _window(**fields):
    return UniqueWindow.objects.create(**{"queue": "names", "key": "k", "until": _now(), **fields})


def _subscription(**fields):
    return Subscription.objects.create(**{"topic": "names", "queue": "names", **fields})


def _run(**fields):
    return WorkflowRun.objects.create(**{"name": "names", "created_at": _now(), **fields})


def _one_run():
    """The workflow every step and edge row of a case belongs to: its unique (workflow, name) must take all three."""
    return WorkflowRun.objects.filter(name="names").first() or _run()


def _step(**fields):
    position = WorkflowStep.objects.count()
    return WorkflowStep.objects.create(**{"workflow": _one_run(), "name": "names", "position": position, **fields})


def _edge(**fields):
    return WorkflowEdge.objects.create(**{"workflow": _one_run(), "parent": "p", "child": "c", "position": 0, **fields})


# (role, table, the field holding the name, a function making a row with that field set)
STORED = [
    ("queue", "message", "queue", lambda name: _message(queue=name, key="k")),
    ("queue", "archive", "queue", lambda name: _archived(queue=name)),
    ("queue", "queue state", "queue", lambda name: QueueState.objects.create(queue=name)),
    ("queue", "subscription", "queue", lambda name: _subscription(queue=name)),
    ("queue", "queue stat", "queue", lambda name: _stat(queue=name)),
    ("queue", "schedule", "queue", lambda name: _schedule(name=f"s{len(name)}{name.strip()}", queue=name)),
    ("queue", "group", "queue", lambda name: _group(queue=name)),
    ("queue", "rate slot", "queue", lambda name: _slot(queue=name)),
    ("queue", "unique window", "queue", lambda name: _window(queue=name)),
    ("kind", "message", "kind", lambda name: _message(kind=name)),
    ("kind", "archive", "kind", lambda name: _archived(kind=name)),
    ("kind", "queue stat", "kind", lambda name: _stat(kind=name)),
    ("kind", "schedule", "kind", lambda name: _schedule(name=f"s{len(name)}{name.strip()}", kind=name)),
    ("key", "message", "key", lambda name: _message(key=name)),
    ("key", "archive", "key", lambda name: _archived(key=name)),
    ("key", "unique window", "key", lambda name: _window(key=name)),
    ("group", "message", "group", lambda name: _message(group=name)),
    ("group", "archive", "group", lambda name: _archived(group=name)),
    ("group", "group", "name", lambda name: _group(name=name)),
    ("group", "rate slot", "group", lambda name: _slot(group=name)),
    ("schedule", "schedule", "name", lambda name: _schedule(name=name)),
    ("schedule", "schedule run", "schedule_id", _schedule_run),
    ("topic", "subscription", "topic", lambda name: _subscription(topic=name)),
    ("workflow", "workflow", "name", lambda name: _run(name=name)),
    ("key", "workflow", "key", lambda name: _run(key=name)),
    ("step", "workflow step", "name", lambda name: _step(name=name)),
    ("queue", "workflow step", "queue", lambda name: _step(name=f"s{len(name)}{name.strip()}", queue=name)),
    ("kind", "workflow step", "kind", lambda name: _step(name=f"s{len(name)}{name.strip()}", kind=name)),
    ("step", "workflow edge", "parent", lambda name: _edge(parent=name)),
    ("step", "workflow edge", "child", lambda name: _edge(child=name)),
]


@pytest.mark.parametrize(
    ("role", "table", "field", "make"), STORED, ids=[f"{role}-{table.replace(' ', '_')}" for role, table, *_ in STORED]
)
def test_acme_Acme_and_acme_space_are_three_names_in_every_role_and_table(role, table, field, make):
    """Three rows, each found by its own name only; a unique key of the table (where it has one) takes all three."""
    rows = []
    for name in NAMES:
        with transaction.atomic():  # a unique key that took two of them for one would raise here
            rows.append(make(name))
    model = type(rows[0])
    for name, row in zip(NAMES, rows, strict=True):
        found = model.objects.filter(**{field: name})
        assert [r.pk for r in found] == [row.pk], name
        assert getattr(found.get(), field) == name
    # Grouped by the database, they stay three.
    assert sorted(model.objects.values_list(field, flat=True).distinct()) == sorted(NAMES)
    assert model.objects.filter(**{f"{field}__in": ["acme"]}).count() == 1


def test_a_subscription_is_its_topic_and_queue_exactly():
    """The subscription role: subscribe() to three topics, or three queues, makes three subscriptions."""
    for name in ("Acme", "acme"):
        django_dbqueue.subscribe(name, "names")
        django_dbqueue.subscribe("names", name)
    Subscription.objects.create(topic="acme ", queue="names")  # a name the API refuses, as plain SQL may write it
    Subscription.objects.create(topic="names", queue="acme ")
    assert django_dbqueue.subscribers("acme") == ["names"]
    assert sorted(Subscription.objects.filter(topic="names").values_list("queue", flat=True)) == sorted(NAMES)
    assert Subscription.objects.count() == 6


# --- the migration on an existing install ---------------------------------------------------


def _insensitive(table, column):
    """Whether ``table.column`` finds 'acme' for 'ACME ' (the server's default collation does)."""
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {qn(table)} WHERE {qn(column)} = %s", ["ACME "])
        return cursor.fetchone()[0] == 1


@pytest.mark.skipif(connection.vendor != "mysql", reason="only MySQL/MariaDB compared names by a default collation")
def test_the_migration_makes_an_existing_install_compare_names_exactly():
    from django.db.migrations.executor import MigrationExecutor

    columns = [
        ("dbqueue_message", "queue"),
        ("dbqueue_message", "group_key"),
        ("dbqueue_archive", "key"),
        ("dbqueue_group", "name"),
        ("dbqueue_schedule", "name"),
        ("dbqueue_schedule_run", "schedule_id"),
    ]
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("django_dbqueue", "0010_flow_control")])
        # The live table as it was then: later migrations add columns the current model writes.
        state = executor.loader.project_state(("django_dbqueue", "0010_flow_control"))
        now = _now()
        state.apps.get_model("django_dbqueue", "Message").objects.create(
            queue="acme", group="acme", payload={}, headers={}, available_at=now, first_available_at=now, created_at=now
        )
        _archived(key="acme")
        _group(name="acme")
        _schedule_run("acme")
        assert all(_insensitive(table, column) for table, column in columns)
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes("django_dbqueue"))
    assert not any(_insensitive(table, column) for table, column in columns)
    assert RECORD not in connection.introspection.table_names()  # no column had a collation of its own
    # The rows made before are all there, and found by their exact name.
    assert Message.objects.get(queue="acme", group="acme")
    assert ScheduleRun.objects.get(schedule_id="acme").schedule.name == "acme"
    # The runs' foreign key to the schedule's name came back (dropped for the change of collation).
    constraints = connection.introspection.get_constraints(connection.cursor(), "dbqueue_schedule_run")
    assert [c["foreign_key"] for c in constraints.values() if c["foreign_key"]] == [("dbqueue_schedule", "name")]
    with pytest.raises(IntegrityError), transaction.atomic():
        _group(name="acme")  # the unique key still holds, exactly
    _group(name="ACME")


# Where migration 0011 writes down a column's collation of its own, for its reverse.
RECORD = "dbqueue_collations_before_0011"


def _collations():
    """Every text column of the queue's tables: {(table, column): (character set, collation)}."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, character_set_name, collation_name FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name LIKE 'dbqueue%%' AND collation_name IS NOT NULL"
        )
        return {(table, column): (charset, collation) for table, column, charset, collation in cursor.fetchall()}


@pytest.mark.skipif(connection.vendor != "mysql", reason="only MySQL/MariaDB compared names by a default collation")
def test_the_migrations_reverse_gives_each_column_back_the_collation_it_had():
    """Not the table's default: a column a DBA changed, a table whose default changed since, a utf8mb3 table,
    and a primary key with the foreign key that refers to it (which must keep the same collation)."""
    from django.db.migrations.executor import MigrationExecutor

    def migrate(target):
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        leaf = executor.loader.graph.leaf_nodes("django_dbqueue")
        executor.migrate(leaf if target is None else [("django_dbqueue", target)])

    with connection.cursor() as cursor:
        cursor.execute("SELECT @@collation_database")
        (default,) = cursor.fetchone()
    charset = default.split("_")[0]
    other = next(name for name in (f"{charset}_general_ci", f"{charset}_unicode_ci") if name != default)
    customised = [
        "ALTER TABLE dbqueue_message MODIFY queue varchar(64) COLLATE {} NOT NULL",
        "ALTER TABLE dbqueue_archive DEFAULT COLLATE {}",
        "ALTER TABLE dbqueue_queue_state CONVERT TO CHARACTER SET {}",
        "ALTER TABLE dbqueue_schedule MODIFY name varchar(100) COLLATE {} NOT NULL",
        "ALTER TABLE dbqueue_schedule_run MODIFY schedule_id varchar(100) COLLATE {} NOT NULL",
    ]
    changed = [other, other, "utf8mb3 COLLATE utf8mb3_general_ci", other, other]
    original = [default, default, f"{charset} COLLATE {default}", default, default]

    def customise(values):
        # The schedule's name and its runs' change together, with the foreign key between them set aside.
        constraints = connection.introspection.get_constraints(connection.cursor(), "dbqueue_schedule_run")
        (key,) = [name for name, c in constraints.items() if c["foreign_key"]]
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE dbqueue_schedule_run DROP FOREIGN KEY {key}")
            for statement, value in zip(customised, values, strict=True):
                cursor.execute(statement.format(value))
            cursor.execute(
                f"ALTER TABLE dbqueue_schedule_run ADD CONSTRAINT {key} FOREIGN KEY (schedule_id) "
                "REFERENCES dbqueue_schedule (name)"
            )

    try:
        migrate("0010_flow_control")
        customise(changed)
        before = _collations()
        assert before[("dbqueue_message", "queue")] == (charset, other)
        assert before[("dbqueue_archive", "key")] == (charset, default)  # the table's default is now another
        assert before[("dbqueue_queue_state", "queue")] == ("utf8mb3", "utf8mb3_general_ci")
        assert before[("dbqueue_schedule_run", "schedule_id")] == (charset, other)
        _schedule_run("acme")
        migrate(None)
        assert _collations()[("dbqueue_message", "queue")][1].endswith("_bin")
        assert RECORD in connection.introspection.table_names()  # the columns that had a collation of their own
        migrate("0010_flow_control")
        assert _collations() == before
        assert RECORD not in connection.introspection.table_names()
        assert ScheduleRun.objects.get(schedule_id="acme").schedule.name == "acme"
        constraints = connection.introspection.get_constraints(connection.cursor(), "dbqueue_schedule_run")
        assert [c["foreign_key"] for c in constraints.values() if c["foreign_key"]] == [("dbqueue_schedule", "name")]
    finally:
        migrate("0010_flow_control")
        customise(original)
        migrate(None)


@pytest.mark.skipif(connection.vendor != "mysql", reason="character sets are MySQL/MariaDB's")
def test_a_name_column_in_a_utf8mb3_table_is_utf8mb4_and_joins_the_tables_other_columns():
    """The collation names its character set, so a name column is utf8mb4 whatever the table's default."""
    definition, params = connection.schema_editor().column_sql(Message, Message._meta.get_field("queue"))
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS names_utf8mb3")
        cursor.execute(
            f"CREATE TABLE names_utf8mb3 (queue {definition}, other varchar(64) NOT NULL) DEFAULT CHARSET=utf8mb3",
            params or None,
        )
        try:
            cursor.execute(
                "SELECT character_set_name, collation_name FROM information_schema.columns "
                "WHERE table_schema = DATABASE() AND table_name = 'names_utf8mb3' ORDER BY column_name"
            )
            (other_set, _), (queue_set, queue_collation) = cursor.fetchall()
            assert (other_set, queue_set) == ("utf8mb3", "utf8mb4")
            assert queue_collation.endswith("_bin")
            cursor.executemany("INSERT INTO names_utf8mb3 VALUES (%s, %s)", [(name, name) for name in NAMES])
            cursor.execute("SELECT COUNT(*) FROM names_utf8mb3 WHERE queue = %s", ["acme"])
            assert cursor.fetchone()[0] == 1
            # Joined with a utf8mb3 column (converted, no "illegal mix of collations"), compared exactly.
            cursor.execute("SELECT COUNT(*) FROM names_utf8mb3 a JOIN names_utf8mb3 b ON a.queue = b.other")
            assert cursor.fetchone()[0] == 3
        finally:
            cursor.execute("DROP TABLE names_utf8mb3")


def test_the_live_claim_index_still_holds_the_name_columns_after_the_migration():
    """MODIFY kept the indexes: the claim's index and the unique keys still cover the converted columns."""
    indexes = connection.introspection.get_constraints(connection.cursor(), "dbqueue_message")
    assert indexes["dbqueue_msg_claim"]["columns"] == ["queue", "priority", "available_at", "id"]
    assert indexes["dbqueue_msg_queue_key"]["unique"]
    assert indexes["dbqueue_msg_queue_key"]["columns"] == ["queue", "key"]
    assert indexes["dbqueue_msg_group"]["columns"] == ["queue", "group_key", "id"]


def test_a_dead_message_keyed_Acme_replays_beside_a_live_acme():
    """Replay refuses a key that is live: "acme" being live is no reason to refuse "Acme"."""
    from django_dbqueue.control import replay

    dead = _archived(queue="q-names", key="Acme", outcome="dead")
    _message(queue="q-names", key="acme")
    assert replay(dead).key == "Acme"
    assert sorted(Message.objects.filter(queue="q-names").values_list("key", flat=True)) == ["Acme", "acme"]


def test_searches_still_ignore_case_on_every_database():
    """The admin's search box (``icontains``) finds "Nightly" for "NIGHT", on MySQL/MariaDB as elsewhere."""
    for name in NAMES:
        _schedule(name=name, queue=name.upper(), kind=name)
    assert Schedule.objects.filter(name__icontains="ACM").count() == 3
    assert Schedule.objects.filter(queue__istartswith="acme").count() == 3
    assert Schedule.objects.filter(kind__iexact="ACME").count() == 2
    assert Schedule.objects.filter(kind__iendswith="ME").count() == 2
    assert Schedule.objects.filter(name="acme").count() == 1  # equality stays exact
