"""``manage.py reapqueue``: a thin parser over :class:`django_dbqueue.reaper.Reaper`."""

from __future__ import annotations

import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbqueue.management.arguments import add_database_argument, positive_float
from django_dbqueue.reaper import Reaper, ReapReport


class Command(BaseCommand):
    help = "Release dead workers' messages, dead-letter poison messages, expire, and prune the archive."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep reaping every --interval seconds.")
        parser.add_argument(
            "--interval", type=positive_float, help="Seconds between passes with --loop (default: REAP_INTERVAL)."
        )
        add_database_argument(parser, "The database to reap")

    def handle(self, *args: Any, **options: Any) -> None:
        reaper = Reaper(using=options["database"])
        if not options["loop"]:
            report = reaper.run_once()
            self.stdout.write("another reaper holds the lock; nothing done" if report is None else str(report))
            return
        try:
            reaper.loop(threading.Event(), options["interval"], on_report=self.print_report)
        except KeyboardInterrupt:
            return

    def print_report(self, report: ReapReport) -> None:
        self.stdout.write(str(report))
