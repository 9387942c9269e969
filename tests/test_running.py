"""Running one claimed message through its handler: django_dbqueue.running."""

from datetime import timedelta

import pytest
from django.utils import timezone

import django_dbqueue
from django_dbqueue import handlers
from django_dbqueue.models import ArchivedMessage, Message
from django_dbqueue.running import HandlerOutcome, process

pytestmark = pytest.mark.django_db(transaction=True)


def claim_one(payload=None, **options):
    django_dbqueue.enqueue("jobs", payload or {}, **options)
    return Message.objects.claim("jobs")[0]


def test_return_acks_with_the_result(handler):
    handler("jobs")(lambda m: {"doubled": m.payload["n"] * 2})
    assert process(claim_one({"n": 4})) == HandlerOutcome.ACKED
    assert ArchivedMessage.objects.acked().get().result == {"doubled": 8}


def test_kind_specific_handler_wins_over_catch_all(handler):
    handler("jobs")(lambda m: "any")
    handler("jobs", kind="special")(lambda m: "special")
    process(claim_one(kind="special"))
    assert ArchivedMessage.objects.get().result == "special"


def test_exception_fails_and_retries(handler):
    handler("jobs")(lambda m: 1 / 0)
    assert process(claim_one()) == HandlerOutcome.FAILED
    assert "ZeroDivisionError" in Message.objects.scheduled().get().last_error


def test_control_exceptions(handler):
    @handler("jobs")
    def control(message):
        action = message.payload["do"]
        if action == "reject":
            raise django_dbqueue.Reject("bad order")
        if action == "retry":
            raise django_dbqueue.Retry(delay=600)
        raise django_dbqueue.Defer(until=timezone.now() + timedelta(days=1))

    assert process(claim_one({"do": "reject"})) == HandlerOutcome.REJECTED
    assert ArchivedMessage.objects.dead().get().last_error == "bad order"
    assert process(claim_one({"do": "retry"})) == HandlerOutcome.RETRIED
    retried = Message.objects.scheduled().get()
    assert retried.attempts == 1 and retried.available_at > timezone.now() + timedelta(minutes=9)
    retried.delete()
    assert process(claim_one({"do": "defer"})) == HandlerOutcome.DEFERRED
    deferred = Message.objects.scheduled().get()
    assert deferred.attempts == 0 and deferred.available_at > timezone.now() + timedelta(hours=23)


def test_no_handler_dead_letters_naming_queue_and_kind():
    assert process(claim_one(kind="mystery")) == HandlerOutcome.UNHANDLED
    assert ArchivedMessage.objects.dead().get().last_error == "no handler for queue 'jobs', kind 'mystery'"


def test_no_handler_can_leave_the_message_queued(settings):
    settings.DBQUEUE = {"QUEUES": {"jobs": {"UNHANDLED": "keep"}}}
    assert process(claim_one()) == HandlerOutcome.UNHANDLED
    kept = Message.objects.get()
    assert kept.attempts == 0 and kept.lease_token is None


def test_duplicate_registration_is_refused(handler):
    handler("jobs")(lambda m: 1)

    def other(message):
        return 2

    with pytest.raises(Exception, match="two handlers for queue 'jobs'"):
        handlers.handler("jobs")(other)


def test_retry_on_the_last_attempt_dead_letters(handler):
    handler("jobs")(lambda m: (_ for _ in ()).throw(django_dbqueue.Retry(delay=1, reason="later")))
    assert process(claim_one(max_attempts=1)) == HandlerOutcome.REJECTED
    row = ArchivedMessage.objects.dead().get()
    assert row.last_error == "later; no attempts left (1 made)"


@pytest.mark.parametrize("gives_up", ["release", "fail"])
def test_a_handler_that_gives_up_its_own_message_is_lease_lost(handler, gives_up):
    """Its lease token is gone: recording raised NotClaimed, which the worker turned into a failure, which raised..."""
    handler("jobs")(lambda m: m.release() if gives_up == "release" else m.fail("by the handler"))
    message = claim_one()
    assert process(message) == HandlerOutcome.LEASE_LOST
    live = Message.objects.get()  # what the handler did stands: given back, or failed (retried later)
    assert live.pk == message.pk and live.lease_token is None
    assert live.last_error == ("" if gives_up == "release" else "by the handler")


def test_after_record_is_told_the_written_outcome_and_cannot_undo_it(handler, caplog):
    class Announcing:
        def __init__(self):
            self.told = []

        def __call__(self, message):
            if message.payload.get("fail"):
                raise ValueError("no")
            return "done"

        def after_record(self, message, outcome):
            # What it is told is already in the database.
            self.told.append((message.pk, outcome, ArchivedMessage.objects.filter(message_id=message.pk).exists()))
            if outcome == HandlerOutcome.FAILED:
                raise RuntimeError("a listener broke")

    announcing = Announcing()
    handler("jobs")(announcing)
    ok, failing = claim_one(), claim_one({"fail": True})
    assert process(ok) == HandlerOutcome.ACKED and process(failing) == HandlerOutcome.FAILED
    assert announcing.told == [(ok.pk, HandlerOutcome.ACKED, True), (failing.pk, HandlerOutcome.FAILED, False)]
    assert Message.objects.get().last_error.rstrip().endswith("ValueError: no")  # the failure is recorded
    assert "after_record of a handler failed" in caplog.text
    stale = claim_one()
    stale.lease_token = "not-ours"
    assert process(stale) == HandlerOutcome.LEASE_LOST
    assert announcing.told[-1] == (stale.pk, HandlerOutcome.LEASE_LOST, False)


def test_the_old_dispatch_module_still_imports_with_a_deprecation_warning():
    import importlib
    import sys

    sys.modules.pop("django_dbqueue.dispatch", None)
    with pytest.warns(DeprecationWarning, match="django_dbqueue.running"):
        dispatch = importlib.import_module("django_dbqueue.dispatch")
    assert dispatch.Outcome is HandlerOutcome and dispatch.process is process
