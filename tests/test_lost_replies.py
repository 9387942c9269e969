"""Answers that are true after a lost connection (docs/reliability.md, "Lost connections").

A connection that drops after a statement was sent leaves the client not
knowing whether the work was done: the reply of a COMMIT that succeeded
never arrives. Each test here puts a fault-injecting proxy
(tests/support/proxy.py) between the queue and the real MariaDB or
PostgreSQL server, runs an operation once to learn the statements it
sends, then runs it again on fresh messages with the connection cut
before, and then after, each of those statements in turn. After every cut:
nothing lost, nothing archived twice, and the operation's answer is what
the database holds (acked when the ack committed; "lease lost" only when
the lease was). SQLite has no connection to cut; the read-back itself is
tested on every database at the end of this file.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.db.utils import OperationalError
from django.utils import timezone

import django_dbqueue
from django_dbqueue import signals
from django_dbqueue.control import CancelResult, cancel, release_lease
from django_dbqueue.db import errors
from django_dbqueue.db.clock import DbNow
from django_dbqueue.db.errors import DATABASE_TROUBLE
from django_dbqueue.models import ArchivedMessage, Message, Outcome, wakeups
from django_dbqueue.models import landed as landed_module
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from tests.support.proxy import ALIAS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", ALIAS])

QUEUE = "px"


def shape(statement: str) -> str:
    """The part of a statement that names it and holds no value (ids, tokens and times differ per run)."""
    return re.match(r"[^'\d$%]*", statement).group(0)[:80].strip()  # type: ignore[union-attr]


def fresh_connection() -> None:
    connections[ALIAS].close()
    connections[ALIAS].ensure_connection()


def claim(n: int = 1, queue: str = QUEUE, **options: Any) -> list[Message]:
    """Enqueue ``n`` messages and claim them through the proxied alias (no fault armed)."""
    for i in range(n):
        django_dbqueue.enqueue(queue, {"i": i}, **options)
    claimed = Message.objects.using(ALIAS).claim(queue, n, visibility_timeout=300, worker="w-proxy")
    assert len(claimed) == n
    return claimed


def archived(message: Message) -> list[ArchivedMessage]:
    return list(ArchivedMessage.objects.filter(message_id=message.pk))


def live(message: Message) -> Message | None:
    return Message.objects.filter(pk=message.pk).first()


def finished_once(message: Message, outcome: str) -> None:
    """Archived exactly once, as ``outcome``, and gone from the live table."""
    rows = archived(message)
    assert [row.outcome for row in rows] == [outcome], rows
    assert live(message) is None


# --- the operations, each: prepare() -> state, run(state) -> answer, check(state, answer) -------------


@dataclass
class Operation:
    prepare: Any
    run: Any
    check: Any
    after: Any = None  # the check after a cut *after* a statement, when it differs


def check_claim(state: None, answer: list[Message]) -> None:
    # Exactly one claim of the one message: leased under the token the caller got, its first attempt.
    (message,) = answer
    row = live(message)
    assert row is not None and row.lease_token == message.lease_token and row.attempts == 1
    assert Message.objects.count() == 1


def check_ack(message: Message, answer: bool) -> None:
    assert answer is True
    finished_once(message, Outcome.ACKED)


def check_ack_unarchived(message: Message, answer: bool | None) -> None:
    # ARCHIVE off, the ack not sent: its retry acks.
    assert answer is True
    assert live(message) is None and archived(message) == []


def check_ack_unarchived_landed(message: Message, answer: bool | None) -> None:
    # ARCHIVE off, the ack done and its reply lost: gone without a trace, which a delete would leave too.
    assert answer is None
    assert live(message) is None and archived(message) == []


def check_ack_many(messages: list[Message], answer: list[bool]) -> None:
    assert answer == [True] * len(messages)
    for message in messages:
        finished_once(message, Outcome.ACKED)


def check_fail(message: Message, answer: bool) -> None:
    assert answer is True
    row = live(message)
    assert row is not None and row.lease_token is None and row.attempts == 1 and "boom" in row.last_error
    assert archived(message) == []


def check_dead(message: Message, answer: bool) -> None:
    assert answer is True
    finished_once(message, Outcome.DEAD)


def check_snooze(message: Message, answer: bool) -> None:
    assert answer is True
    row = live(message)
    assert row is not None and row.lease_token is None and row.attempts == 0 and row.deferrals == 1
    assert archived(message) == []


def check_extend(message: Message, answer: bool) -> None:
    assert answer is True
    row = live(message)
    assert row is not None and row.lease_token == message.lease_token
    assert row.available_at > message.available_at + timedelta(seconds=300)


def check_release(message: Message, answer: bool) -> None:
    assert answer is True
    row = live(message)
    assert row is not None and row.lease_token is None and row.attempts == 0 and row.claimed_by == ""


def check_cancel(message: Message, answer: str) -> None:
    assert answer == CancelResult.ARCHIVED
    finished_once(message, Outcome.CANCELLED)


def check_cancel_running(message: Message, answer: str) -> None:
    assert answer == CancelResult.REQUESTED
    row = live(message)
    assert row is not None and row.cancel_requested_at is not None and row.lease_token == message.lease_token


def chain_root() -> Message:
    """The claimed root of a fresh two-step chain (a, b), through the proxied alias. The nudge's
    addresses are read again by each run, so that every run sends the statements the rehearsal did."""
    wakeups.forget()
    workflow = django_dbqueue.Workflow("px-chain")
    workflow.chain(django_dbqueue.Step("a", QUEUE, {}), django_dbqueue.Step("b", QUEUE, {}))
    workflow.enqueue()
    (root,) = Message.objects.using(ALIAS).claim(QUEUE, 1, visibility_timeout=300, worker="w-proxy")
    return root


def check_ack_then_claim(root: Message, answer: tuple[list[bool | None], list[Message]]) -> None:
    # The root acked once; its released step b leased once, to the caller, under the lease it was given.
    answers, taken = answer
    assert answers == [True]
    finished_once(root, Outcome.ACKED)
    (b,) = taken
    row = live(b)
    assert b.headers["dbqueue_step"][1] == "b"
    assert row is not None and (row.lease_token, row.attempts, row.claimed_by) == (b.lease_token, 1, "w-proxy")


def waiting() -> Message:
    """A message nobody runs, read through the proxied alias."""
    return Message.objects.using(ALIAS).get(pk=django_dbqueue.enqueue(QUEUE, {}).pk)


OPERATIONS = {
    "claim": Operation(
        lambda: django_dbqueue.enqueue(QUEUE, {}) and None,
        lambda _: Message.objects.using(ALIAS).claim(QUEUE, 5, visibility_timeout=300, worker="w-proxy"),
        check_claim,
    ),
    "ack": Operation(lambda: claim()[0], lambda m: m.ack(), check_ack),
    "ack, no archive": Operation(
        lambda: claim(queue="no-archive")[0], lambda m: m.ack(), check_ack_unarchived, check_ack_unarchived_landed
    ),
    "ack_many": Operation(lambda: claim(3), lambda ms: Message.objects.ack_many(ms, worker="w-proxy"), check_ack_many),
    "ack_then_claim, a chain's step": Operation(
        chain_root,
        lambda m: Message.objects.using(ALIAS).ack_then_claim(
            [m], [QUEUE], 1, worker="w-proxy", visibility_timeout=300
        ),
        check_ack_then_claim,
    ),
    "fail": Operation(lambda: claim()[0], lambda m: m.fail("boom"), check_fail),
    "fail, dead": Operation(lambda: claim(max_attempts=1)[0], lambda m: m.fail("boom"), check_dead),
    "snooze": Operation(lambda: claim()[0], lambda m: m.snooze(delay=60), check_snooze),
    "heartbeat": Operation(lambda: claim()[0], lambda m: m.extend_lease(900), check_extend),
    "release": Operation(lambda: claim()[0], lambda m: m.release(), check_release),
    "cancel": Operation(waiting, lambda m: cancel(m, by="ops"), check_cancel),
    "cancel, running": Operation(lambda: claim()[0], lambda m: cancel(m, by="ops"), check_cancel_running),
}


def rehearse(proxy, operation: Operation) -> list[str]:
    """The statements ``operation`` sends, in order, with no fault."""
    state = operation.prepare()
    fresh_connection()
    proxy.forget()
    answer = operation.run(state)
    operation.check(state, answer)
    statements = proxy.recorded()
    Message.objects.all().delete()
    ArchivedMessage.objects.all().delete()
    return statements


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_a_connection_cut_at_any_statement_gives_the_true_answer(fault_proxy, name, when):
    operation = OPERATIONS[name]
    statements = rehearse(fault_proxy, operation)
    assert statements, "the operation sent nothing through the proxy"
    for index, statement in enumerate(statements):
        named = shape(statement)
        occurrence = sum(1 for earlier in statements[: index + 1] if named in earlier)
        state = operation.prepare()
        fresh_connection()
        rule = fault_proxy.cut(named, when=when, occurrence=occurrence)
        answer = operation.run(state)
        assert rule.fired.is_set(), f"no cut at statement {index} ({named!r}): it was not sent again"
        check = operation.after if when == "after" and operation.after is not None else operation.check
        try:
            check(state, answer)
        except AssertionError as exc:
            raise AssertionError(f"cut {when} statement {index} of {len(statements)}: {statement[:200]!r}") from exc
        fault_proxy.disarm()
        Message.objects.all().delete()
        ArchivedMessage.objects.all().delete()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_signalled_finish_after_a_lost_reply_is_announced_once(fault_proxy, when):
    """With a receiver connected, a finish goes through the ORM; its signal goes out once, with the row."""
    heard = []

    def receiver(sender, message, archived, **kwargs):
        heard.append((message.pk, archived.pk if archived is not None else None))

    signals.message_acked.connect(receiver, weak=False)
    try:
        for statement in ("dbqueue_archive", "COMMIT"):
            message = claim()[0]
            fresh_connection()
            fault_proxy.cut(statement, when=when)
            assert message.ack() is True
            fault_proxy.disarm()
            finished_once(message, Outcome.ACKED)
            (row,) = archived(message)
            assert heard == [(message.pk, row.pk)]
            heard.clear()
    finally:
        signals.message_acked.disconnect(receiver)


@pytest.mark.parametrize("operation", ["ack", "ack_many", "fail", "snooze", "release"])
def test_a_lease_that_really_ran_out_is_still_lost_after_a_cut(fault_proxy, operation):
    """The read-back never claims work it did not do: a lease that ran out before the cut is "lease lost"."""
    message = claim()[0]
    Message.objects.filter(pk=message.pk).update(available_at=DbNow(-1))
    fresh_connection()
    fault_proxy.cut("dbqueue_message", when="after")
    run = {
        "ack": lambda: message.ack(),
        "ack_many": lambda: Message.objects.ack_many([message])[0],
        "fail": lambda: message.fail("boom"),
        "snooze": lambda: message.snooze(delay=60),
        "release": lambda: message.release(),
    }[operation]
    assert run() is False
    row = live(message)
    assert row is not None and row.lease_token == message.lease_token and archived(message) == []


# --- a queue with ARCHIVE off: an ack leaves no row to read back ------------------------------------


def test_an_unarchived_ack_of_a_long_handler_whose_reply_was_lost_is_unknown_not_lease_lost(fault_proxy):
    """The heartbeat pushed the lease on in the database, not on the message object, whose lease end is
    past: the ack held the lease and landed. "Lease lost" would be false, and an ack cannot be proved (a
    delete leaves the same nothing behind): the answer is unknown (None)."""
    django_dbqueue.enqueue("no-archive", {})
    (message,) = Message.objects.using(ALIAS).claim("no-archive", 1, visibility_timeout=1, worker="w-proxy")
    assert Message.objects.extend_leases(message.lease_token, [message.pk], 300) == 1  # the heartbeat's write
    time.sleep(1.5)  # past the lease end the object knows
    fresh_connection()
    rule = fault_proxy.cut("dbqueue_message", when="after")
    assert message.ack() is None
    assert rule.fired.is_set()
    assert live(message) is None and archived(message) == []


@pytest.mark.parametrize(("meanwhile", "answer"), [("cancelled", False), ("deleted", None)])
def test_an_unarchived_ack_whose_message_went_another_way_meanwhile_is_never_an_ack(fault_proxy, meanwhile, answer):
    """The ack is held on its way (a stalled network); meanwhile an operator takes the message back and
    cancels it, or deletes it; then the connection drops: the ack never reached the server. A cancel
    leaves its archive row: lease lost (False). A delete leaves nothing, as the ack would have: unknown."""
    message = claim(queue="no-archive")[0]
    fresh_connection()
    rule = fault_proxy.stall("dbqueue_message", when="before")
    answers = []
    acking = threading.Thread(target=lambda: answers.append(message.ack()))
    acking.start()
    assert rule.fired.wait(30), "the ack's statement never reached the proxy"
    if meanwhile == "cancelled":
        assert release_lease(Message.objects.get(pk=message.pk))
        assert cancel(message.pk, by="ops") == CancelResult.ARCHIVED
    else:
        Message.objects.filter(pk=message.pk).delete()
    fault_proxy.cut_all()  # the stalled statement is dropped with its connection, never sent
    acking.join(60)
    assert not acking.is_alive()
    assert answers == [answer]
    assert live(message) is None
    assert [row.outcome for row in archived(message)] == ([Outcome.CANCELLED] if meanwhile == "cancelled" else [])


# --- a worker whose connection is cut ------------------------------------------------------------------


WORKER_CUTS = {
    # (statement, following): the claim's or the acknowledgement's last statement on each database.
    ("mysql", "claim"): ("COMMIT", "UPDATE `dbqueue_message` SET `lease_token`"),
    ("mysql", "ack"): ("COMMIT", "dbqueue_archive"),
    ("postgresql", "claim"): ("WITH picked AS", None),
    ("postgresql", "ack"): ("dbqueue_archive", None),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("step", "retries"), [("claim", 5), ("ack", 5), ("ack", 0)])
def test_a_worker_whose_connection_is_cut_goes_on_and_loses_nothing(
    fault_proxy, settings, handler, caplog, step, retries, when
):
    """``retries=0``: the queue operation gives up at once and the worker's writer retries the batch:
    the read-back happens there (the batch's messages stay marked unsure across the two layers)."""
    queues = {**settings.DBQUEUE["QUEUES"], "px-w": {"DATABASE": ALIAS}}
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": queues, "TRANSIENT_RETRIES": retries}
    runs = Counter()
    lock = threading.Lock()

    @handler("px-w")
    def count(message):
        with lock:
            runs[message.pk] += 1

    sent = [django_dbqueue.enqueue("px-w", {"i": i}) for i in range(12)]
    statement, following = WORKER_CUTS[(connections["default"].vendor, step)]
    rule = fault_proxy.cut(statement, when=when, following=following)
    status = QueueWorker(
        WorkerConfig(queues=["px-w"], until_empty=True, max_runtime=60, batch_size=4, concurrency=1)
    ).run()
    assert rule.fired.is_set()
    assert status == ExitStatus.OK
    for message in sent:
        finished_once(message, Outcome.ACKED)
    assert set(runs) == {m.pk for m in sent}
    assert max(runs.values()) == 1, runs  # no handler ran twice: the claim's and the ack's answers were true
    assert "lease lost" not in caplog.text  # an ack that committed is not reported as lost


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_heartbeat_whose_connection_is_cut_keeps_the_lease_at_its_next_beat(
    fault_proxy, settings, handler, caplog, when
):
    """Leases of 3 s, handlers of 4.5 s: the heartbeat (every second) is cut once, logs it, extends at the
    next beat; no lease runs out, each message runs once and is acked."""
    queues = {**settings.DBQUEUE["QUEUES"], "px-hb": {"DATABASE": ALIAS, "VISIBILITY_TIMEOUT": 3}}
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": queues}
    runs = Counter()

    @handler("px-hb")
    def slow(message):
        runs[message.pk] += 1
        time.sleep(4.5)

    sent = [django_dbqueue.enqueue("px-hb", {"i": i}) for i in range(2)]
    quote = "`" if connections["default"].vendor == "mysql" else '"'
    rule = fault_proxy.cut(f"SET {quote}available_at{quote}", when=when)
    status = QueueWorker(WorkerConfig(queues=["px-hb"], until_empty=True, max_runtime=60, batch_size=2)).run()
    assert rule.fired.is_set()
    assert status == ExitStatus.OK
    for message in sent:
        finished_once(message, Outcome.ACKED)
    assert runs == {m.pk: 1 for m in sent}
    assert "heartbeat failed" in caplog.text
    assert "lease lost" not in caplog.text


UNARCHIVED_ACK_CUTS = {
    # The worker's batched ack on a queue with ARCHIVE off: its last statement on each database.
    "mysql": ("COMMIT", "DELETE FROM `dbqueue_message`"),
    "postgresql": ("WITH gone AS", None),
}


@pytest.mark.slow
def test_a_worker_whose_unarchived_ack_lost_its_reply_says_it_is_unknown_not_lease_lost(
    fault_proxy, settings, handler, caplog
):
    """Leases of 3 s, a handler of 4.5 s that the heartbeat keeps leased, ARCHIVE off: the batch's ack
    lands and its reply is lost. Nothing in the database says this ack took the message away: the
    worker says that much, once, and not "lease lost"."""
    queues = {
        **settings.DBQUEUE["QUEUES"],
        "px-na": {"DATABASE": ALIAS, "VISIBILITY_TIMEOUT": 3, "ARCHIVE": False},
    }
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": queues}
    runs = Counter()

    @handler("px-na")
    def slow(message):
        runs[message.pk] += 1
        time.sleep(4.5)

    sent = django_dbqueue.enqueue("px-na", {})
    statement, following = UNARCHIVED_ACK_CUTS[connections["default"].vendor]
    rule = fault_proxy.cut(statement, when="after", following=following)
    status = QueueWorker(WorkerConfig(queues=["px-na"], until_empty=True, max_runtime=60)).run()
    assert rule.fired.is_set()
    assert status == ExitStatus.OK
    assert live(sent) is None and archived(sent) == []
    assert runs == {sent.pk: 1}
    assert "lease lost" not in caplog.text
    assert caplog.text.count(f"message {sent.pk}: the reply of its ack was lost and the message is gone") == 1


# --- the read-back itself, on every database ---------------------------------------------------------


def mark_unsure(*messages: Message) -> None:
    for message in messages:
        message.__dict__[landed_module.UNSURE] = True


@pytest.mark.parametrize(
    "operation",
    ["ack", "ack_many", "fail", "dead", "snooze", "release"],
)
def test_an_unsure_change_that_landed_is_answered_from_the_database(operation):
    """The second try of a change whose first try landed (its reply lost, as marked) answers True; unmarked, False."""
    django_dbqueue.enqueue("px", {})
    (message,) = Message.objects.claim("px", 1, worker="w-1")
    if operation == "dead":
        message.max_attempts = 1
        Message.objects.filter(pk=message.pk).update(max_attempts=1)
    run = {
        "ack": lambda: message.ack(),
        "ack_many": lambda: Message.objects.ack_many([message])[0],
        "fail": lambda: message.fail("boom"),
        "dead": lambda: message.fail("boom"),
        "snooze": lambda: message.snooze(delay=60),
        "release": lambda: message.release(),
    }[operation]
    before = message.__dict__.copy()
    assert run() is True
    message.__dict__.update(before)  # the object as it was when the first try's reply was lost
    assert run() is False  # not marked: a repeated change is refused, as before
    mark_unsure(message)
    assert run() is True
    assert not landed_module.unsure(message)


def test_an_unsure_change_that_did_not_land_is_lease_lost():
    """Another worker's later lease, or the reaper's give-back, is not mistaken for this lease's change."""
    django_dbqueue.enqueue("px", {})
    (message,) = Message.objects.claim("px", 1, worker="w-1")
    Message.objects.filter(pk=message.pk).update(available_at=DbNow(-1))
    (again,) = Message.objects.claim("px", 1, worker="w-2")
    assert again.ack() is True
    mark_unsure(message)
    assert message.ack() is False
    assert Message.objects.ack_many([message]) == [False]

    django_dbqueue.enqueue("px", {})
    (other,) = Message.objects.claim("px", 1, worker="w-1")
    Message.objects.release_from("w-1")  # the reaper takes w-1 for dead: its lease is given back, attempt counted
    mark_unsure(other)
    assert other.fail("boom") is False
    assert other.snooze(delay=5) is False
    assert other.release() is False


def test_an_unsure_unarchived_ack_is_answered_from_the_live_table_and_the_archive():
    """ARCHIVE off. Still live: not acked (False). Gone with an archive row (a cancel): not this ack
    (False). Gone without a trace, whether this ack (its object's lease end left behind by the
    heartbeat), a delete or another lease's ack took it: unknown (None), never True."""

    def claimed(worker="w-1"):
        django_dbqueue.enqueue("no-archive", {})
        (message,) = Message.objects.claim("no-archive", 1, worker=worker)
        return message

    stale = timezone.now() - timedelta(minutes=1)  # the claim's lease end, as a heartbeat leaves it on the object
    message = claimed()
    before = message.__dict__.copy()
    assert message.ack() is True
    message.__dict__.update(before)
    message.available_at = stale
    mark_unsure(message)
    assert message.ack() is None
    assert not landed_module.unsure(message)
    message.__dict__.update(before)
    message.available_at = stale
    mark_unsure(message)
    assert Message.objects.ack_many([message]) == [None]

    cancelled = claimed()
    assert release_lease(Message.objects.get(pk=cancelled.pk))
    assert cancel(cancelled.pk, by="ops") == CancelResult.ARCHIVED
    mark_unsure(cancelled)
    assert cancelled.ack() is False
    mark_unsure(cancelled)
    assert Message.objects.ack_many([cancelled]) == [False]

    deleted = claimed()
    Message.objects.filter(pk=deleted.pk).delete()
    mark_unsure(deleted)
    assert deleted.ack() is None

    first = claimed()
    Message.objects.filter(pk=first.pk).update(available_at=DbNow(-1))
    (again,) = Message.objects.claim("no-archive", 1, worker="w-2")
    mark_unsure(first)
    assert first.ack() is False  # live, under w-2's lease
    assert again.ack() is True
    mark_unsure(first)
    assert first.ack() is None  # gone: w-2's ack and this one's would leave the same nothing


# --- the proxy itself ----------------------------------------------------------------------------------


def test_the_proxy_delays_and_stalls_without_losing_anything(fault_proxy):
    """A delay slows every statement down; a stall holds one until released; the answers stay true."""
    message = claim()[0]
    fault_proxy.delay(0.05)
    started = time.monotonic()
    assert message.extend_lease(600) is True
    assert time.monotonic() - started >= 0.05
    fault_proxy.delay(0)

    fresh_connection()
    rule = fault_proxy.stall("dbqueue_archive", when="after")
    answers = []
    acking = threading.Thread(target=lambda: answers.append(message.ack()))
    acking.start()
    assert rule.fired.wait(30), "the ack's statement never reached the proxy"
    acking.join(0.5)
    assert acking.is_alive(), "a stalled statement was answered"
    rule.release.set()
    acking.join(30)
    assert answers == [True]
    finished_once(message, Outcome.ACKED)


def test_a_stalled_reply_then_a_cut_is_answered_from_the_database(fault_proxy):
    """The reply held (a network stall), then every connection dropped (a failover): the ack that
    committed is acked, once."""
    message = claim()[0]
    fresh_connection()
    statement = "COMMIT" if connections["default"].vendor == "mysql" else "dbqueue_archive"
    following = "dbqueue_archive" if statement == "COMMIT" else None
    rule = fault_proxy.stall(statement, when="after", following=following)
    answers = []
    acking = threading.Thread(target=lambda: answers.append(message.ack()))
    acking.start()
    assert rule.fired.wait(30)
    fault_proxy.cut_all()
    acking.join(60)
    assert not acking.is_alive()
    assert answers == [True]
    finished_once(message, Outcome.ACKED)


def test_a_cut_connection_leaves_the_outcome_unknown_and_a_deadlock_does_not(fault_proxy):
    """The read-back follows only errors that may have lost a reply; a deadlock is an answer (rolled back)."""
    fresh_connection()
    fault_proxy.cut("SELECT 41", when="after")
    with pytest.raises(DATABASE_TROUBLE) as cut, connections[ALIAS].cursor() as cursor:
        cursor.execute("SELECT 41")
    assert errors.is_transient(cut.value, ALIAS) and errors.outcome_unknown(cut.value, ALIAS)
    connections[ALIAS].close()
    if connections["default"].vendor == "mysql":
        import MySQLdb

        deadlock = OperationalError(1213, "Deadlock found when trying to get lock")
        deadlock.__cause__ = MySQLdb.OperationalError(1213, "Deadlock found when trying to get lock")
    else:
        import psycopg

        deadlock = OperationalError("deadlock detected")
        deadlock.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    assert errors.is_transient(deadlock, ALIAS) and not errors.outcome_unknown(deadlock, ALIAS)
