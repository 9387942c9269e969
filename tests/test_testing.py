"""The testing tools: the ``dbqueue`` fixture, the TestCase mixin, the immediate mode, moving time."""

import tomllib
from datetime import timedelta

import pytest
from django.test import TestCase

import django_dbqueue
from django_dbqueue import handlers
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.testing import QueueStillBusy, QueueTestMixin
from tests.support.processes import ROOT

calls = []


@pytest.fixture
def shop():
    """Handlers of a small shop: orders start an email; 'flaky' fails; 'again' enqueues itself for ever."""
    calls.clear()

    @handlers.handler("orders")
    def order(message):
        calls.append(("order", message.payload["n"]))
        django_dbqueue.enqueue("mails", {"order": message.payload["n"]}, kind="confirm")
        calls.append(("order done", message.payload["n"]))
        return message.payload["n"]

    @handlers.handler("mails")
    def mail(message):
        calls.append(("mail", message.payload["order"]))

    @handlers.handler("flaky")
    def flaky(message):
        raise ConnectionError("mail server busy")

    @handlers.handler("again")
    def again(message):
        django_dbqueue.enqueue("again", {})

    yield
    for queue in ("orders", "mails", "flaky", "again"):
        handlers.unregister(queue, None)


# --- asserting what was enqueued (on the test's own connection, inside its transaction) ---


@pytest.mark.django_db
def test_assert_enqueued_finds_matching_messages(dbqueue):
    django_dbqueue.enqueue("mails", {"to": "a@example.com", "lines": [1, 2]}, kind="welcome")
    django_dbqueue.enqueue("mails", {"to": "b@example.com"}, kind="reset")
    [found] = dbqueue.assert_enqueued("mails", kind="welcome", payload__contains={"to": "a@example.com"})
    assert found.payload["lines"] == [1, 2]
    assert len(dbqueue.assert_enqueued("mails", payload__contains={"to": "@example.com"}, count=2)) == 2
    dbqueue.assert_enqueued("mails", payload__contains={"lines": [2]})
    assert [m.kind for m in dbqueue.enqueued("mails")] == ["welcome", "reset"]
    dbqueue.assert_not_enqueued("mails", kind="invoice")


@pytest.mark.django_db
def test_a_failed_assert_enqueued_says_what_the_queue_holds(dbqueue):
    django_dbqueue.enqueue("mails", {"to": "a@example.com"}, kind="welcome")
    django_dbqueue.enqueue("other", {})
    with pytest.raises(AssertionError) as failure:
        dbqueue.assert_enqueued("mails", kind="welcome", payload__contains={"to": "z@example.com"})
    text = str(failure.value)
    assert "expected at least one message(s) in queue 'mails' with kind='welcome', " in text
    assert "payload__contains={'to': 'z@example.com'}, found 0; queue 'mails' holds 1:" in text
    assert "kind='welcome' payload={'to': 'a@example.com'}" in text
    assert "other queues with messages: other" in text
    with pytest.raises(AssertionError, match=r"expected 2 message\(s\) in queue 'mails', found 1"):
        dbqueue.assert_enqueued("mails", count=2)
    with pytest.raises(AssertionError, match="expected no message in queue 'mails', found 1"):
        dbqueue.assert_not_enqueued("mails")


# --- running messages in the test's process ---


@pytest.mark.django_db
def test_run_until_empty_runs_handlers_and_what_they_enqueue(dbqueue, shop):
    django_dbqueue.enqueue_many("orders", [{"n": 1}, {"n": 2}])
    assert dbqueue.run_until_empty() == {"acked": 4}
    assert sorted(c for c in calls if c[0] == "mail") == [("mail", 1), ("mail", 2)]
    assert [r.result for r in dbqueue.archived("orders", outcome=Outcome.ACKED)] == [1, 2]
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_run_until_empty_of_some_queues_leaves_the_others(dbqueue, shop):
    django_dbqueue.enqueue("orders", {"n": 1})
    assert dbqueue.run_until_empty(queues=["orders"]) == {"acked": 1}
    dbqueue.assert_enqueued("mails", kind="confirm", payload={"order": 1})


@pytest.mark.django_db
def test_failures_are_recorded_as_a_worker_records_them(dbqueue, shop, settings):
    settings.DBQUEUE = {"QUEUES": {"flaky": {"BACKOFF_BASE": 60}}}
    django_dbqueue.enqueue("flaky", {}, max_attempts=2)
    assert dbqueue.run_until_empty("flaky") == {"failed": 1}
    [waiting] = dbqueue.enqueued("flaky")
    assert waiting.attempts == 1 and "ConnectionError: mail server busy" in waiting.last_error
    assert dbqueue.run_until_empty("flaky") == {}  # its backoff has not passed
    dbqueue.advance(timedelta(minutes=2))
    assert dbqueue.run_until_empty("flaky") == {"failed": 1}
    [dead] = dbqueue.archived("flaky", outcome=Outcome.DEAD)
    assert dead.attempts == 2


@pytest.mark.django_db
def test_a_handler_that_never_lets_the_queue_empty_stops_at_max_runs(dbqueue, shop):
    django_dbqueue.enqueue("again", {})
    with pytest.raises(QueueStillBusy, match=r"still messages ready in again after 5 runs \(max_runs\)"):
        dbqueue.run_until_empty("again", max_runs=5)
    assert Message.objects.filter(queue="again", lease_token__isnull=False).count() == 0  # nothing left claimed
    with pytest.raises(ValueError, match="max_runs must be a positive integer, not 0"):
        dbqueue.run_until_empty("again", max_runs=0)


# --- time ---


@pytest.mark.django_db
def test_advance_lets_delays_come_due(dbqueue, shop):
    django_dbqueue.enqueue("mails", {"order": 7}, delay=3600)
    assert dbqueue.run_until_empty() == {}
    assert dbqueue.advance(3590) == 1
    assert dbqueue.run_until_empty() == {}
    dbqueue.advance(timedelta(seconds=11), queues="mails")
    assert dbqueue.run_until_empty() == {"acked": 1}
    with pytest.raises(ValueError, match="amount"):
        dbqueue.advance("soon")


@pytest.mark.django_db
def test_advance_runs_out_leases_and_expiry(dbqueue):
    django_dbqueue.enqueue("jobs", {}, expires_at=django_dbqueue_now() + timedelta(hours=1))
    [held] = Message.objects.claim("jobs", visibility_timeout=300)
    assert not Message.objects.claimable(5).exists()
    dbqueue.advance(301)
    assert not held.ack()  # the lease ran out
    assert Message.objects.claimable(5).count() == 1
    dbqueue.advance(3600)
    assert Message.objects.expired().count() == 1


@pytest.mark.django_db
def test_make_ready_runs_scheduled_messages_now(dbqueue, shop):
    django_dbqueue.enqueue("mails", {"order": 1}, run_at=django_dbqueue_now() + timedelta(days=30))
    django_dbqueue.enqueue("orders", {"n": 2}, delay=600)
    assert dbqueue.make_ready("mails") == 1
    assert dbqueue.run_until_empty() == {"acked": 1}
    assert dbqueue.make_ready() == 1
    assert dbqueue.run_until_empty() == {"acked": 2}


def django_dbqueue_now():
    from django_dbqueue.db.clock import db_now

    return db_now("default")


# --- the immediate mode ---


@pytest.mark.django_db(transaction=True)
def test_immediate_mode_by_setting_runs_on_commit_with_worker_semantics(settings, shop):
    settings.DBQUEUE = {"MODE": "immediate", "QUEUES": {"flaky": {"BACKOFF_BASE": 0}}}
    django_dbqueue.enqueue("orders", {"n": 1})
    # The mail the order enqueued ran after the order's handler, not inside it.
    assert calls == [("order", 1), ("order done", 1), ("mail", 1)]
    assert not Message.objects.exists()
    django_dbqueue.enqueue("flaky", {}, max_attempts=3)
    dead = ArchivedMessage.objects.get(queue="flaky")
    assert dead.outcome == Outcome.DEAD and dead.attempts == 3
    settings.DBQUEUE = {}
    django_dbqueue.enqueue("orders", {"n": 2})
    assert Message.objects.filter(queue="orders").count() == 1  # back to workers


@pytest.mark.django_db(transaction=True)
def test_immediate_mode_waits_for_the_commit(dbqueue_immediate, shop):
    from django.db import transaction

    with transaction.atomic():
        django_dbqueue.enqueue("orders", {"n": 5})
        assert calls == []
        dbqueue_immediate.assert_enqueued("orders", payload={"n": 5})
    assert calls == [("order", 5), ("order done", 5), ("mail", 5)]
    with transaction.atomic():
        django_dbqueue.enqueue("orders", {"n": 6})
        transaction.set_rollback(True)
    assert calls[-1] == ("mail", 5) and not Message.objects.exists()


@pytest.mark.django_db
def test_immediate_mode_in_a_test_transaction_runs_with_captured_commits(
    dbqueue, shop, django_capture_on_commit_callbacks
):
    with dbqueue.immediate(), django_capture_on_commit_callbacks(execute=True):
        django_dbqueue.enqueue("orders", {"n": 3})
    assert ("mail", 3) in calls
    django_dbqueue.enqueue("orders", {"n": 4})  # outside the block: left for workers
    dbqueue.assert_enqueued("orders", payload={"n": 4})


def test_mode_is_checked(settings):
    from django_dbqueue.conf import find_problems

    assert find_problems({"MODE": "eager"}) == ["DBQUEUE['MODE'] must be one of 'worker', 'immediate', not 'eager'"]


# --- Django's TestCase, and the plugin ---


class MixinTests(QueueTestMixin, TestCase):
    def setUp(self):
        handlers.handler("mixin")(lambda message: message.payload["n"] * 2)
        self.addCleanup(handlers.unregister, "mixin", None)

    def test_the_mixin_gives_the_same_methods(self):
        django_dbqueue.enqueue("mixin", {"n": 21}, delay=60)
        self.assert_enqueued("mixin", payload__contains={"n": 21})
        self.assertEqual(self.run_until_empty("mixin"), {})
        self.advance(61)
        self.assertEqual(self.run_until_empty("mixin"), {"acked": 1})
        self.assertEqual(self.archived("mixin")[0].result, 42)

    def test_immediate_mode_with_captured_commits(self):
        with self.immediate(), self.captureOnCommitCallbacks(execute=True):
            django_dbqueue.enqueue("mixin", {"n": 2})
        self.assertEqual(self.archived("mixin")[0].result, 4)


def test_the_plugin_is_registered_by_its_entry_point(request):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"dbqueue": "django_dbqueue.testing.pytest_plugin"}
    assert any(
        getattr(plugin, "__name__", "") == "django_dbqueue.testing.pytest_plugin"
        for plugin in request.config.pluginmanager.get_plugins()
    )
