"""``manage.py reapqueue``: a thin parser over :class:`django_dbqueue.reaper.Reaper`."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbqueue.conf import get_settings
from django_dbqueue.reaper import Reaper


class Command(BaseCommand):
    help = "Release dead workers' messages, dead-letter poison messages, expire, and prune the archive."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep reaping every --interval seconds.")
        parser.add_argument("--interval", type=float, help="Seconds between passes with --loop (REAP_INTERVAL).")
        parser.add_argument("--database", default=None, help="Database alias (default: the queues' DATABASE).")

    def handle(self, *args: Any, **options: Any) -> None:
        dbq = get_settings()
        reaper = Reaper(using=options["database"] or dbq.defaults.database)
        interval = options["interval"] or dbq.reap_interval
        try:
            while True:
                report = reaper.run_once()
                if report is None:
                    self.stdout.write("another reaper holds the lock; nothing done")
                elif report.did_something or not options["loop"]:
                    self.stdout.write(str(report))
                if not options["loop"]:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return
