"""``manage.py reapqueue``: a thin parser over `django_dbqueue.reaper.Reaper`."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbqueue.conf import get_settings
from django_dbqueue.management.arguments import add_database_argument, positive_float
from django_dbqueue.management.console import add_console_arguments, command_console, log_banner, log_summary
from django_dbqueue.management.progress import command_progress
from django_dbqueue.management.stopping import stop_on_signals
from django_dbqueue.reaper import Reaper, ReapReport


class Command(BaseCommand):
    help = "Release dead workers' messages, dead-letter poison messages, expire, and prune the archive."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Keep reaping every --interval seconds.")
        parser.add_argument(
            "--interval", type=positive_float, help="Seconds between passes with --loop (default: REAP_INTERVAL)."
        )
        add_database_argument(parser, "The database to reap")
        add_console_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        with command_console(options):
            self.reap(options)

    def reap(self, options: dict[str, Any]) -> None:
        # Pruning a large archive takes a while: a bar on a terminal (none with -v0).
        reaper = Reaper(using=options["database"], progress=command_progress(self.stdout, options["verbosity"]))
        if not options["loop"]:
            report = reaper.run_once()
            self.stdout.write("another reaper holds the lock; nothing done" if report is None else str(report))
            return
        interval = get_settings().reap_interval if options["interval"] is None else options["interval"]
        started = time.monotonic()
        # SIGTERM/SIGINT end the loop after the pass under way (a KeyboardInterrupt in the middle
        # of a pass could leave the reaper's lock held by a process that no longer loops).
        with stop_on_signals() as stop:
            log_banner(f"reaper, a pass every {interval:g}s", reaper.using, interval=interval)
            reaper.loop(stop, interval, on_report=self.print_report)
        elapsed = time.monotonic() - started
        log_summary(f"reaper stops after {elapsed:.1f}s", elapsed=round(elapsed, 3))

    def print_report(self, report: ReapReport) -> None:
        self.stdout.write(str(report))
