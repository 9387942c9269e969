"""``manage.py reapqueue``: a thin parser over :class:`django_dbqueue.reaper.Reaper`."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from django_dbqueue.conf import get_settings
from django_dbqueue.db.errors import DATABASE_TROUBLE
from django_dbqueue.management.arguments import add_database_argument
from django_dbqueue.reaper import Reaper


class Command(BaseCommand):
    help = "Release dead workers' messages, dead-letter poison messages, expire, and prune the archive."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep reaping every --interval seconds.")
        parser.add_argument("--interval", type=float, help="Seconds between passes with --loop (REAP_INTERVAL).")
        add_database_argument(parser, "The database to reap")

    def handle(self, *args: Any, **options: Any) -> None:
        dbq = get_settings()
        reaper = Reaper(using=options["database"])
        interval = options["interval"] or dbq.reap_interval
        if not options["loop"]:
            report = reaper.run_once()
            self.stdout.write("another reaper holds the lock; nothing done" if report is None else str(report))
            return
        try:
            while True:
                try:
                    report = reaper.run_once()
                except DATABASE_TROUBLE as exc:  # an outage outlasting the retries: try again next pass
                    self.stderr.write(f"reaper pass failed: {exc}")
                    connections[reaper.using].close()
                    report = None
                if report is not None and report.did_something:
                    self.stdout.write(str(report))
                time.sleep(interval)
        except KeyboardInterrupt:
            return
