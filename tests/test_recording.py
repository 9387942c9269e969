"""Recording an outcome in the worker: weather waited out, permanent errors recorded otherwise, lost leases logged once.

The worker runs in this process (``QueueWorker.run()``) so that a
model-layer write can be made to fail on cue. A real permanent error
cannot be provoked any more: the model layer makes every value the queue
writes storable before it writes it (``validation.storable_text`` and
``storable_result``), so a stand-in raises what a database raises when it
refuses a value (``DataError``). The same faults in real worker processes
are in tests/test_faults.py.
"""

import logging
import time

import pytest
from django.db import DataError, InterfaceError, connection

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, MessageQuerySet, Outcome
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig

pytestmark = pytest.mark.django_db(transaction=True)

REFUSAL = "value too long for the column (a stand-in)"
STORED = "could not be stored: DataError"


def run(queues, **options) -> ExitStatus:
    return QueueWorker(WorkerConfig(queues=queues, until_empty=True, max_runtime=60, **options)).run()


def fail_once(monkeypatch, method: str, error: Exception) -> dict:
    """Make the first call of ``MessageQuerySet.<method>`` raise ``error``; returns the counts of calls."""
    real = getattr(MessageQuerySet, method)
    counts = {"calls": 0, "raised": 0}

    def patched(self, *args, **kwargs):
        counts["calls"] += 1
        if not counts["raised"]:
            counts["raised"] += 1
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MessageQuerySet, method, patched)
    return counts


def refuse(monkeypatch, pk: int, outcome: str | None = None) -> list:
    """Make the writes of message ``pk`` fail with a DataError: ``ack_many`` of a batch that holds it,
    and ``finish`` with ``outcome`` (any, if None). Returns the tries, in order: "batch", or the outcome."""
    real_finish, real_ack_many = MessageQuerySet.finish, MessageQuerySet.ack_many
    tries = []

    def finish(self, message, finished, *args, **kwargs):
        if message.pk == pk and outcome in (None, finished):
            tries.append(finished)
            raise DataError(REFUSAL)
        return real_finish(self, message, finished, *args, **kwargs)

    def ack_many(self, messages, **kwargs):
        messages = list(messages)
        if pk in {m.pk for m in messages}:
            tries.append("batch")
            raise DataError(REFUSAL)
        return real_ack_many(self, messages, **kwargs)

    monkeypatch.setattr(MessageQuerySet, "finish", finish)
    monkeypatch.setattr(MessageQuerySet, "ack_many", ack_many)
    return tries


# --- weather ---------------------------------------------------------------------------


def test_weather_recording_an_outcome_is_waited_out(monkeypatch, caplog):
    """A lost connection while acknowledging: retried until written, the handler not run again."""
    real = MessageQuerySet.ack_many
    failures = {"left": 2}

    def ack_many(self, messages, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise InterfaceError(0, "")  # what mysqlclient raises on a connection the server dropped
        return real(self, messages, **kwargs)

    monkeypatch.setattr(MessageQuerySet, "ack_many", ack_many)
    message = django_dbqueue.enqueue("w-ok", {})
    assert run(["w-ok"]) == ExitStatus.OK
    assert failures["left"] == 0 and caplog.text.count("retrying") == 2
    row = ArchivedMessage.objects.get(message_id=message.pk)
    assert row.outcome == Outcome.ACKED and row.attempts == 1


def test_a_stopping_worker_gives_up_an_outage_after_the_grace(monkeypatch, caplog):
    """The database never comes back: a stop still ends the worker once the grace is over; the lease will expire."""

    def finish(self, *args, **kwargs):
        raise InterfaceError(0, "")

    monkeypatch.setattr(MessageQuerySet, "finish", finish)
    monkeypatch.setattr(MessageQuerySet, "ack_many", finish)
    message = django_dbqueue.enqueue("w-ok", {})
    started = time.monotonic()
    status = QueueWorker(WorkerConfig(queues=["w-ok"], max_runtime=1, grace=1)).run()
    assert status == ExitStatus.ABANDONED
    assert time.monotonic() - started < 30
    assert Message.objects.in_flight().get().pk == message.pk  # its lease will expire; it runs again
    assert "gave up, the worker is exiting" in caplog.text


# --- permanent errors ----------------------------------------------------------------------

PERMANENT = [
    # (handler's action, the write that fails once, the message's fate, words of its error)
    pytest.param(
        "ok",
        "finish",
        Outcome.DEAD,
        "the handler succeeded, but its outcome (acked) could not be stored: DataError",
        id="ack",
    ),
    pytest.param("reject", "finish", Outcome.DEAD, f"its outcome (rejected) {STORED}", id="dead"),
    pytest.param("raise", "update_leased", "live", f"its outcome (failed) {STORED}", id="fail"),
    pytest.param("retry", "update_leased", "live", f"its outcome (retried) {STORED}", id="retry"),
    pytest.param("defer", "update_leased", "live", f"its outcome (deferred) {STORED}", id="snooze"),
]


@pytest.mark.parametrize(("action", "method", "fate", "words"), PERMANENT)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_permanent_error_is_never_retried_and_the_message_is_recorded_otherwise(
    monkeypatch, caplog, settings, action, method, fate, words, batch_size
):
    """A DataError writing an outcome used to be retried for ever (any DatabaseError was weather).

    Now it is written once: an ack or a dead letter that cannot be stored
    is dead-lettered, any other outcome is a failed attempt, each with an
    error that says what could not be stored; the next message runs.
    """
    settings.DBQUEUE = {**settings.DBQUEUE, "BACKOFF_BASE": 60}
    message = django_dbqueue.enqueue("w-outcomes", {"action": action})
    following = django_dbqueue.enqueue("w-outcomes", {"action": "ok"})
    batched_ack = action == "ok"
    if batched_ack:
        # Acks are written a batch at a time (one message, or three); when that fails for good, one by one,
        # and each alone succeeds.
        method, fate, words = "ack_many", Outcome.ACKED, None
    counts = fail_once(monkeypatch, method, DataError(REFUSAL))
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        assert run(["w-outcomes"], batch_size=batch_size) == ExitStatus.OK
    assert counts["raised"] == 1 and "retrying" not in caplog.text
    assert ArchivedMessage.objects.get(message_id=following.pk).outcome == Outcome.ACKED
    if fate == "live":
        live = Message.objects.get(pk=message.pk)
        assert live.lease_token is None and live.attempts == 1 and words in live.last_error
    else:
        row = ArchivedMessage.objects.get(message_id=message.pk)
        assert row.outcome == fate
        if words:
            assert words in row.last_error and REFUSAL in row.last_error
    if batched_ack:
        assert "writing them one by one" in caplog.text
    else:
        assert f"message {message.pk}: its outcome" in caplog.text  # logged, with the database's error


def test_in_a_batch_one_ack_that_cannot_be_stored_does_not_block_the_others(monkeypatch, caplog):
    """ack_many failing for good used to hold back every ack of the batch; now they are written one by one."""
    sent = django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(5)])
    bad = sent[2]
    refused = refuse(monkeypatch, bad.pk, Outcome.ACKED)
    assert run(["w-ok"], batch_size=5) == ExitStatus.OK
    assert refused == ["batch", Outcome.ACKED]  # each write tried once
    outcomes = dict(ArchivedMessage.objects.values_list("message_id", "outcome"))
    assert outcomes == {m.pk: Outcome.DEAD if m.pk == bad.pk else Outcome.ACKED for m in sent}
    assert not Message.objects.exists()
    assert "writing them one by one" in caplog.text


def test_when_nothing_can_be_stored_the_message_is_left_to_its_lease(monkeypatch, caplog):
    """Not even a bare dead letter can be written: the worker goes on, and the message's lease will expire."""
    stuck = django_dbqueue.enqueue("w-ok", {"n": 1})
    tries = refuse(monkeypatch, stuck.pk)
    following = django_dbqueue.enqueue("w-ok", {"n": 2})
    assert run(["w-ok"]) == ExitStatus.OK
    # The batch's ack, its ack alone, the dead letter, the bare one: once each.
    assert tries == ["batch", Outcome.ACKED, Outcome.DEAD, Outcome.DEAD]
    assert Message.objects.in_flight().get().pk == stuck.pk
    assert ArchivedMessage.objects.get(message_id=following.pk).outcome == Outcome.ACKED


@pytest.mark.slow
def test_a_write_the_server_drops_every_time_is_not_retried_for_ever():
    """MariaDB drops the connection on a statement past max_allowed_packet: "gone away", which looks like weather."""
    if connection.vendor != "mysql":
        pytest.skip("max_allowed_packet is MySQL's and MariaDB's")
    import threading

    from django_dbqueue.worker.writing import DroppedWrite, Writer

    with connection.cursor() as cursor:
        cursor.execute("SELECT @@max_allowed_packet")
        limit = cursor.fetchone()[0]
    huge = "a" * (4 * limit + 1000)

    def write():
        with connection.cursor() as cursor:
            cursor.execute("SELECT LENGTH(%s)", [huge])

    writer = Writer("default", "test", threading.Event())
    started = time.monotonic()
    # The server drops the connection each time (or refuses the packet outright: 1153, permanent).
    with pytest.raises(Exception) as caught:
        writer.until_written(write, "a huge write")
    assert time.monotonic() - started < 60
    assert isinstance(caught.value, DroppedWrite) or "max_allowed_packet" in str(caught.value), caught.value
    connection.close()
    with connection.cursor() as cursor:  # the connection works again
        cursor.execute("SELECT 1")


# --- lease lost ---------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("gives_up", ["release", "fail", "ack"])
def test_a_handler_that_gives_up_its_own_message_is_lease_lost_once(handler, caplog, gives_up, batch_size):
    """The worker used to spin on it (single) or lose the batch's other acks in a dead thread (batches)."""
    given_up = set()

    @handler("w-self")
    def gives_up_its_message(message):
        if message.payload.get("mine") and message.pk not in given_up:
            given_up.add(message.pk)  # once: a released message comes back, and then runs as usual
            {"release": message.release, "fail": lambda: message.fail("by the handler"), "ack": message.ack}[gives_up]()
        return "done"

    mine = django_dbqueue.enqueue("w-self", {"mine": True}, max_attempts=1)
    others = django_dbqueue.enqueue_many("w-self", [{"n": n} for n in range(2)])
    with caplog.at_level(logging.WARNING, logger="django_dbqueue"):
        assert run(["w-self"], batch_size=batch_size) == ExitStatus.OK
    assert caplog.text.count("lease lost") == 1
    assert f"message {mine.pk}: lease lost" in caplog.text
    fate = {"release": Outcome.ACKED, "fail": Outcome.DEAD, "ack": Outcome.ACKED}[gives_up]
    assert ArchivedMessage.objects.get(message_id=mine.pk).outcome == fate
    for other in others:
        assert ArchivedMessage.objects.get(message_id=other.pk).outcome == Outcome.ACKED
    assert not Message.objects.exists()
