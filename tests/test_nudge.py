"""Waking idle workers without LISTEN/NOTIFY: a datagram from the producer once its enqueue commits."""

import queue as stdlib_queue
import signal
import socket
import threading

import pytest
from django.db import connection, transaction
from django.test.utils import override_settings

import django_dbqueue
from django_dbqueue.conf import find_problems
from django_dbqueue.db import notify
from django_dbqueue.models import ArchivedMessage, Worker, wakeups
from tests.support.factories import WorkerFactory
from tests.support.processes import start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

no_notify = pytest.mark.skipif(
    connection.vendor == "postgresql", reason="PostgreSQL wakes workers with NOTIFY; nothing is nudged there"
)


@pytest.fixture
def receiver():
    """A nudge socket on the loopback, its datagrams collected in a queue, for the test's length."""
    endpoint = notify.NudgeReceiver("127.0.0.1")
    heard: stdlib_queue.Queue[str] = stdlib_queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=endpoint.run, args=(stop.is_set, heard.put), daemon=True)
    thread.start()
    wakeups.forget()
    yield endpoint.address, heard
    stop.set()
    thread.join(timeout=5)
    wakeups.forget()


def assert_silent(heard: stdlib_queue.Queue) -> None:
    """Nothing arrives: a nudge is sent at the commit, so one would be here in far less than 0.3 s."""
    with pytest.raises(stdlib_queue.Empty):
        heard.get(timeout=0.3)


def test_a_nudge_reaches_the_receiver_and_a_lost_one_raises_nothing(receiver):
    address, heard = receiver
    assert address.startswith("127.0.0.1:")
    notify.nudge(address, "emails")
    assert heard.get(timeout=5) == "emails"
    # Nobody there, a malformed address, an unknown host: dropped, never raised.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    for address in (gone, "no-port", "nowhere.invalid:9"):
        notify.nudge(address, "emails")


def test_a_failing_socket_is_waited_out_not_raised(caplog):
    """A receive error (staged: the kernel gives none on demand) must not end the listener, or the worker."""
    endpoint = notify.NudgeReceiver("127.0.0.1")
    real = endpoint.socket

    class Failing:
        """The socket, but its first receive fails."""

        failed = False

        def recv(self, size):
            if not Failing.failed:
                Failing.failed = True
                raise OSError(105, "No buffer space available")
            return real.recv(size)

        def getsockname(self):
            return real.getsockname()

        def close(self):
            real.close()

    endpoint.socket = Failing()
    heard: stdlib_queue.Queue[str] = stdlib_queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=endpoint.run, args=(stop.is_set, heard.put), kwargs={"pause": 0.01})
    thread.start()
    try:
        notify.nudge(endpoint.address, "emails")
        assert heard.get(timeout=5) == "emails"
    finally:
        stop.set()
        thread.join(timeout=5)
    assert Failing.failed and "No buffer space available" in caplog.text
    assert real.fileno() == -1  # closed when it stopped


@no_notify
def test_an_enqueue_nudges_the_workers_of_its_queue_once_it_commits(receiver):
    address, heard = receiver
    WorkerFactory(hostname=socket.gethostname(), queues=["emails", "sms"], nudge_address=address)
    WorkerFactory(queues=["reports"], nudge_address="127.0.0.1:9")  # another queue's worker: not nudged
    with transaction.atomic():
        django_dbqueue.enqueue("emails", {})
        assert_silent(heard)  # not before the commit: the worker could not see the message yet
    assert heard.get(timeout=5) == "emails"
    django_dbqueue.enqueue_many("sms", [{}, {}, {}])
    assert heard.get(timeout=5) == "sms"  # once per call and queue, not per message
    assert_silent(heard)


@no_notify
def test_a_rolled_back_enqueue_and_a_live_key_nudge_nobody(receiver):
    address, heard = receiver
    WorkerFactory(hostname=socket.gethostname(), queues=["emails"], nudge_address=address)
    django_dbqueue.enqueue("emails", {}, key="k")
    assert heard.get(timeout=5) == "emails"
    django_dbqueue.enqueue("emails", {}, key="k")  # found live: nothing new to claim
    assert_silent(heard)
    with pytest.raises(RuntimeError), transaction.atomic():
        django_dbqueue.enqueue("emails", {})
        raise RuntimeError("rolled back")
    assert_silent(heard)


@no_notify
def test_without_nudge_host_nothing_is_sent_and_a_changed_setting_is_seen_at_once(receiver):
    address, heard = receiver
    WorkerFactory(hostname=socket.gethostname(), queues=["emails"], nudge_address=address)
    django_dbqueue.enqueue("emails", {})  # decides, once for the alias, that it nudges
    assert heard.get(timeout=5) == "emails"
    with override_settings(DBQUEUE={"NUDGE_HOST": None}):
        django_dbqueue.enqueue("emails", {})
        assert_silent(heard)
    django_dbqueue.enqueue("emails", {})  # the setting back: decided again
    assert heard.get(timeout=5) == "emails"


def test_loopback_addresses_of_other_hosts_are_left_out():
    here = socket.gethostname()
    WorkerFactory(hostname=here, queues=["q"], nudge_address="127.0.0.1:7001")
    WorkerFactory(hostname="elsewhere", queues=["q"], nudge_address="127.0.0.1:7002")  # its own loopback
    WorkerFactory(hostname="elsewhere", queues=["q", "r"], nudge_address="10.1.2.3:7003")
    WorkerFactory(hostname=here, queues=["q"], nudge_address="")  # takes no nudges
    found = {queue: sorted(addresses) for queue, addresses in Worker.objects.nudge_addresses().items()}
    assert found == {"q": ["10.1.2.3:7003", "127.0.0.1:7001"], "r": ["10.1.2.3:7003"]}


@pytest.mark.parametrize("value", ["", " 127.0.0.1", 7, "x" * 256])
def test_a_bad_nudge_host_is_named(value):
    [problem] = find_problems({"NUDGE_HOST": value})
    assert problem.startswith("DBQUEUE['NUDGE_HOST'] must be the address workers bind")


@no_notify
@pytest.mark.slow
def test_an_idle_worker_polling_every_30_seconds_runs_a_new_message_at_once():
    worker = start_worker("w-ok", "--poll-interval", "30", "--max-poll-interval", "30", "--max-runtime", "120")
    try:
        row = wait_for(lambda: Worker.objects.filter(pid=worker.pid).first(), what="the worker row")
        assert row.nudge_address.startswith("127.0.0.1:")
        # Its first claim found nothing: it now waits 30 seconds, unless nudged.
        threading.Event().wait(1.0)
        message = django_dbqueue.enqueue("w-ok", {"n": 1})
        wait_for(
            lambda: ArchivedMessage.objects.filter(message_id=message.pk).exists(),
            timeout=10,
            what="the nudged worker to run the message (polling alone would take 30 s)",
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
