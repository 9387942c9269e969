"""Enqueue a handful of messages, process them, and print what happened.

Part 1: plain enqueue, retries, a dead letter, a deduplication key.
Part 2: orders saved with the transactional outbox, fanned out by topic
"orders" to queues "email" and "invoicing", whose handlers write rows; one
address always fails, so a dead letter is left to fix and replay.
Part 3: request/reply with a worker in another thread.
Throughout: the lifecycle signals, counted.
Last: the commands to replay the dead letter and to open the admin on this
database, printed so that they work when pasted (this Python, this database).
"""

import logging
import os
import shlex
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

import django_dbqueue
from django_dbqueue import signals
from django_dbqueue.models import ArchivedMessage, Message
from django_dbqueue.worker import QueueWorker, WorkerConfig
from shop.models import EmailSent, Invoice, Order

DEMO_QUEUES = ["emails", "email", "invoicing", "quotes"]
DEMO_LOGIN = ("demo", "demo")  # an admin login on the example's own database, for looking around


class Rollback(Exception):
    """Raised inside a transaction to show that a rolled-back order sends nothing."""


class Command(BaseCommand):
    help = "Run the django-dbqueue demo on the configured database."

    def handle(self, *args, **options):
        self.reset()
        heard = Counter()

        def count(sender, signal, **kwargs):
            heard[next(name for name, known in signals.SIGNALS.items() if known is signal)] += 1

        for signal in signals.SIGNALS.values():
            signal.connect(count, dispatch_uid="shop-demo")
        try:
            self.plain_enqueue()
            self.orders()
            self.request_reply()
        finally:
            for signal in signals.SIGNALS.values():
                signal.disconnect(dispatch_uid="shop-demo")
        self.stdout.write("\nSignals sent: " + ", ".join(f"{name} {heard[name]}" for name in signals.SIGNALS))
        self.next_steps()

    def reset(self):
        Message.objects.filter(queue__in=DEMO_QUEUES).delete()
        Message.objects.filter(queue__startswith="reply.").delete()
        ArchivedMessage.objects.filter(queue__in=DEMO_QUEUES).delete()
        ArchivedMessage.objects.filter(queue__startswith="reply.").delete()
        Order.objects.all().delete()  # and their emails and invoices
        django_dbqueue.subscribe("orders", "invoicing")  # as migration shop 0002 did, in case it was removed

    # --- part 1 ----------------------------------------------------------------------

    def plain_enqueue(self):
        out = self.stdout.write
        out("Enqueueing messages on queue 'emails'...")
        django_dbqueue.enqueue("emails", {"to": "ada@example.com"}, kind="welcome")
        django_dbqueue.enqueue("emails", {"to": "not-an-address"}, kind="welcome")
        django_dbqueue.enqueue("emails", {"to": "bob@example.com", "flaky": True}, kind="receipt")
        django_dbqueue.enqueue_many("emails", [{"to": "cy@example.com"}, {"to": "di@example.com"}], kind="news")
        again = django_dbqueue.enqueue("emails", {"to": "cy@example.com"}, kind="news", key="news-cy")
        dup = django_dbqueue.enqueue("emails", {"to": "cy@example.com"}, kind="news", key="news-cy")
        out(f"  key 'news-cy' enqueued twice -> one message (#{again.pk} == #{dup.pk})")
        out(f"  live: {Message.objects.filter(queue='emails').counts_by_queue()}")

        out("\nRunning a worker until the queue is empty (one line per message):")
        self.run_worker(["emails"])
        self.archive_report(["emails"])
        out(f"\nLive messages left: {Message.objects.filter(queue='emails').count()}")

    # --- part 2 ----------------------------------------------------------------------

    def orders(self):
        out = self.stdout.write
        out(f"\nTopic 'orders' -> queues {django_dbqueue.subscribers('orders')} (settings and the Subscription table)")
        out("Saving orders; each new order publishes 'order-placed' in the same transaction:")
        for number, email, total in [
            ("A-1001", "ada@example.com", "12.50"),
            ("A-1002", "bob@example.com", "40.00"),
            ("A-1003", "cy@mail.example.invalid", "7.25"),
        ]:
            with transaction.atomic():
                Order.objects.create(number=number, email=email, total=Decimal(total))
            out(f"  order {number} for {email} committed")
        try:
            with transaction.atomic():
                Order.objects.create(number="A-1004", email="di@example.com", total=Decimal("1.00"))
                raise Rollback
        except Rollback:
            out("  order A-1004 rolled back: no order, no message")
        live = Message.objects.filter(queue__in=["email", "invoicing"]).counts_by_queue()
        out(f"  live: {live}")

        out("\nRunning a worker on 'email' and 'invoicing' (one line per message):")
        self.run_worker(["email", "invoicing"])
        out("\nRows the handlers wrote:")
        for email in EmailSent.objects.select_related("order"):
            out(f"  EmailSent  {email.subject!r} to {email.to}")
        for invoice in Invoice.objects.select_related("order"):
            out(f"  Invoice    {invoice.number} for order {invoice.order.number}, {invoice.amount}")
        self.archive_report(["email", "invoicing"])
        dead = ArchivedMessage.objects.dead().filter(queue="email").first()
        if dead is not None:
            out(f"\nMessage #{dead.message_id} ({dead.queue}, {dead.kind}) waits in the archive as a dead letter.")

    # --- part 3 ----------------------------------------------------------------------

    def request_reply(self):
        out = self.stdout.write
        out("\nRequest/reply: a worker thread serves 'quotes' and answers with reply():")
        worker = QueueWorker(WorkerConfig(queues=["quotes"], max_runtime=60))
        thread = threading.Thread(target=worker.run, name="demo-quotes-worker")
        with self.worker_lines(printed=False):
            thread.start()
            self.ask_for_quotes(worker, thread)
        left = Message.objects.filter(queue__startswith="reply.").count()
        out(f"  reply queues left behind: {left}")

    def ask_for_quotes(self, worker, thread):
        out = self.stdout.write
        try:
            for sku, quantity in [("tea", 3), ("coffee", 2)]:
                answer = django_dbqueue.request("quotes", {"sku": sku, "quantity": quantity}, timeout=30)
                out(f"  request {sku} x{quantity} -> reply {answer}")
            try:
                django_dbqueue.request("quotes", {"sku": "cake", "quantity": 1}, timeout=30)
            except django_dbqueue.RequestFailed as exc:
                out(f"  request cake x1 -> {type(exc).__name__}: {exc}")
        finally:
            worker.stop("demo done")
            thread.join(timeout=60)

    # --- what to do next -------------------------------------------------------------

    def next_steps(self):
        """Commands that work when pasted: this Python, this project's directory, this database."""
        out = self.stdout.write
        user, password = DEMO_LOGIN
        users = get_user_model().objects
        if not users.filter(username=user).exists():
            users.create_superuser(user, f"{user}@example.com", password)
        out(f"\nOpen the admin on the demo's data (log in as {user!r}, password {password!r}):")
        out(f"  {manage_py('runserver')}")
        out("  then http://127.0.0.1:8000/admin/django_dbqueue/deadletter/ (Ctrl-C stops the server)")
        dead = ArchivedMessage.objects.dead().filter(queue="email").first()
        if dead is not None:
            code = (  # double quotes inside, so that the shell's single quotes wrap it whole
                "import django_dbqueue; from django_dbqueue.models import ArchivedMessage; "
                "from shop.models import Order; "
                'Order.objects.filter(number="A-1003").update(email="cy@example.com"); '
                f'row = ArchivedMessage.objects.dead().get(queue="{dead.queue}", message_id={dead.message_id}); '
                'print("message", row.message_id, "replayed as message", django_dbqueue.replay(row, by="demo").pk)'
            )
            out(
                f"\nFix message #{dead.message_id}'s address and replay it: in the admin (Dead letters: 'Replay', "
                "or 'Edit and replay' to correct its payload), or with:"
            )
            out(f"  {manage_py('shell', '-c', code)}")
            out(f"and process it: {manage_py('runqueueworker', 'email', '--until-empty')}")

    # --- helpers ---------------------------------------------------------------------

    def run_worker(self, queues):
        with self.worker_lines(printed=True):
            deadline = time.monotonic() + 30
            # A failed message waits out its backoff (scheduled, not ready), so run again until none is left.
            while Message.objects.filter(queue__in=queues).exists() and time.monotonic() < deadline:
                QueueWorker(WorkerConfig(queues=queues, batch_size=10, until_empty=True)).run()
                time.sleep(0.2)

    @contextmanager
    def worker_lines(self, printed):
        """The queue's log records go to the demo alone while its workers run: one line per event.

        ``printed``: a line per finished message on stdout (its error's last line, no traceback:
        the archive report shows errors); otherwise nothing, as the demo prints the outcome itself.
        Any handler the project's LOGGING set (``DBQUEUE_LOG_LEVEL``) is set aside meanwhile.
        """
        log = logging.getLogger("django_dbqueue")
        handler = logging.StreamHandler(self.stdout) if printed else logging.NullHandler()
        handler.setFormatter(MessageLine())
        handler.addFilter(lambda record: record.getMessage().startswith("message ") and " in " in record.getMessage())
        saved, level = log.handlers[:], log.level
        for other in saved:
            log.removeHandler(other)
        log.addHandler(handler)
        log.setLevel(logging.DEBUG if printed else logging.WARNING)
        try:
            yield
        finally:
            log.removeHandler(handler)
            for other in saved:
                log.addHandler(other)
            log.setLevel(level)

    def archive_report(self, queues):
        out = self.stdout.write
        out("\nArchive:")
        for row in ArchivedMessage.objects.filter(queue__in=queues).order_by("message_id"):
            error = f"  ({row.last_error.strip().splitlines()[-1]})" if row.last_error else ""
            queue = f"{row.queue:<10} " if len(queues) > 1 else ""
            out(f"  #{row.message_id:<4} {queue}{row.kind:<8} {row.outcome:<6} attempts={row.attempts}{error}")


class MessageLine(logging.Formatter):
    """A worker's line about a message, indented, without the traceback a failure's record carries."""

    def format(self, record):
        return f"  {record.getMessage()}"


def manage_py(*arguments: str) -> str:
    """A shell command running ``manage.py`` as this run did: same Python, directory and database."""
    command = [sys.executable, "manage.py", *arguments]
    url = os.environ.get("DATABASE_URL")  # unset: the settings' default, a file next to manage.py
    database = f"DATABASE_URL={shlex.quote(url)} " if url else ""
    return f"cd {shlex.quote(str(settings.BASE_DIR))} && {database}{shlex.join(command)}"
