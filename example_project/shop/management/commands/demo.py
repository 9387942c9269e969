"""Enqueue a handful of messages, process them, and print what happened."""

import logging
import time

from django.core.management.base import BaseCommand

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message
from django_dbqueue.worker import QueueWorker, WorkerConfig


class Command(BaseCommand):
    help = "Run the django-dbqueue demo on the configured database."

    def handle(self, *args, **options):
        Message.objects.filter(queue="emails").delete()
        ArchivedMessage.objects.filter(queue="emails").delete()
        out = self.stdout.write
        out("Enqueueing messages on queue 'emails'...")
        django_dbqueue.enqueue("emails", {"to": "ada@example.com"}, kind="welcome")
        django_dbqueue.enqueue("emails", {"to": "not-an-address"}, kind="welcome")
        django_dbqueue.enqueue("emails", {"to": "bob@example.com", "flaky": True}, kind="receipt")
        django_dbqueue.enqueue_many("emails", [{"to": "cy@example.com"}, {"to": "di@example.com"}], kind="news")
        again = django_dbqueue.enqueue("emails", {"to": "cy@example.com"}, kind="news", key="news-cy")
        dup = django_dbqueue.enqueue("emails", {"to": "cy@example.com"}, kind="news", key="news-cy")
        out(f"  key 'news-cy' enqueued twice -> one message (#{again.pk} == #{dup.pk})")
        out(f"  live: {Message.objects.counts_by_queue()}")

        out("\nRunning a worker until the queue is empty (one line per message):")
        log = logging.getLogger("django_dbqueue")
        printer = logging.StreamHandler(self.stdout)
        printer.setFormatter(logging.Formatter("  %(message)s"))
        printer.addFilter(lambda record: record.getMessage().startswith("message ") and " in " in record.getMessage())
        log.addHandler(printer)
        try:
            deadline = time.monotonic() + 30
            # A failed message waits out its backoff (scheduled, not ready), so run again until none is left.
            while Message.objects.filter(queue="emails").exists() and time.monotonic() < deadline:
                QueueWorker(WorkerConfig(queues=["emails"], batch_size=10, until_empty=True)).run()
                time.sleep(0.2)
        finally:
            log.removeHandler(printer)

        out("\nArchive:")
        for row in ArchivedMessage.objects.filter(queue="emails").order_by("message_id"):
            error = f"  ({row.last_error.strip().splitlines()[-1]})" if row.last_error else ""
            out(f"  #{row.message_id:<4} {row.kind:<8} {row.outcome:<6} attempts={row.attempts}{error}")
        out(f"\nLive messages left: {Message.objects.filter(queue='emails').count()}")
