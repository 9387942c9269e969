"""Request/reply: a requester here, a real ``runqueueworker`` process answering."""

import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

import django_dbqueue
from django_dbqueue.exceptions import InvalidOption, RequestFailed, RequestTimeout
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from django_dbqueue.reaper import Reaper
from django_dbqueue.worker import ExitStatus
from tests.support.processes import start_worker, stop, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def answering_worker():
    """A worker process serving queue 'rr-echo', whose handler replies (tests/testapp/queues.py)."""
    worker = start_worker("rr-echo", "--max-runtime", "120", "-v3")
    yield worker
    _, err = stop(worker)
    print("worker's log (a line per message):", err)  # shown by pytest when the test failed
    assert worker.returncode == ExitStatus.OK, err


def test_round_trip_across_two_processes(answering_worker):
    answers = [django_dbqueue.request("rr-echo", {"n": n}, timeout=60) for n in range(3)]
    assert [a["echo"] for a in answers] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert {a["pid"] for a in answers} == {answering_worker.pid}  # answered by the other process
    # Requests are acked with the handler's result (the ack follows the reply); no reply is left behind.
    wait_for(lambda: ArchivedMessage.objects.filter(queue="rr-echo").count() == 3, what="the last request's ack")
    rows = ArchivedMessage.objects.filter(queue="rr-echo").order_by("message_id")
    assert [(r.outcome, r.result) for r in rows] == [(Outcome.ACKED, "answered")] * 3
    correlation_ids = {r.headers["correlation_id"] for r in rows}
    assert len(correlation_ids) == 3 and {r.headers["reply_to"] for r in rows} == {
        f"reply.{c}" for c in correlation_ids
    }
    left = list(Message.objects.filter(queue__startswith="reply.").values())
    assert not left, f"replies left behind: {left}; requests: {list(rows.values())}"
    assert not ArchivedMessage.objects.filter(queue__startswith="reply.").exists()


def test_a_dead_lettered_request_fails_at_once(answering_worker):
    started = time.monotonic()
    with pytest.raises(RequestFailed, match="was dead without a reply: cannot answer that"):
        django_dbqueue.request("rr-echo", {"action": "reject"}, timeout=60)
    assert time.monotonic() - started < 50  # long before the timeout


def test_timeout_without_a_worker_leaves_nothing_to_deliver():
    with pytest.raises(RequestTimeout, match=r"no reply to request \d+ on queue 'rr-echo' within 0\.3s"):
        django_dbqueue.request("rr-echo", {"n": 1}, timeout=0.3)
    sent = Message.objects.get(queue="rr-echo")
    assert sent.expires_at is not None  # nobody will claim it after its deadline...
    assert django_dbqueue.claim("rr-echo") == []
    assert Reaper().run_once().expired == 1  # ...and the reaper archives it
    assert ArchivedMessage.objects.expired().get().message_id == sent.pk
    assert not Message.objects.exists()


def test_a_late_reply_expires_with_the_request():
    with pytest.raises(RequestTimeout):
        django_dbqueue.request("rr-late", {"n": 1}, timeout=0.2)
    sent = Message.objects.get(queue="rr-late")
    sent.expires_at = timezone.now() + timedelta(hours=1)  # a worker that took it just in time
    sent.save(update_fields=["expires_at"])
    [claimed] = django_dbqueue.claim("rr-late")
    claimed.expires_at = timezone.now() - timedelta(seconds=1)  # ...and answers after the deadline
    late = django_dbqueue.reply(claimed, {"too": "late"})
    assert late.queue == sent.headers["reply_to"] and late.key == sent.headers["correlation_id"]
    assert late.headers["in_reply_to"] == sent.pk
    assert Reaper().run_once().expired == 1
    assert ArchivedMessage.objects.expired().get().queue == sent.headers["reply_to"]
    assert not Message.objects.filter(queue__startswith="reply.").exists()


def test_reply_to_a_message_that_was_not_a_request():
    django_dbqueue.enqueue("plain", {})
    [message] = django_dbqueue.claim("plain")
    with pytest.raises(InvalidOption, match="only messages sent with request\\(\\) can be replied to"):
        django_dbqueue.reply(message, {})
    assert Message.objects.count() == 1


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"timeout": 0}, "timeout must be > 0"),
        ({"timeout": "soon"}, "timeout must be a number of seconds"),
        ({"poll_interval": -1}, "poll_interval must be > 0"),
        ({"headers": [1]}, "headers must be a dict"),
    ],
)
def test_bad_requests_are_refused_and_write_nothing(options, words):
    with pytest.raises(django_dbqueue.DbQueueError) as caught:
        django_dbqueue.request("rr-echo", {}, **options)
    assert words in str(caught.value)
    assert not Message.objects.exists()


def test_request_inside_a_transaction_is_refused():
    with pytest.raises(InvalidOption, match=r"inside transaction\.atomic"), transaction.atomic():
        django_dbqueue.request("rr-echo", {}, timeout=1)
    assert not Message.objects.exists()
