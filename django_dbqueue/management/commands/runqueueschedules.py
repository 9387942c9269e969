"""``manage.py runqueueschedules``: a thin parser over `django_dbqueue.schedules.scheduler.Scheduler`."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.exceptions import DbQueueError
from django_dbqueue.management.arguments import positive_float
from django_dbqueue.management.console import add_console_arguments, command_console, log_banner, log_summary
from django_dbqueue.management.stopping import stop_on_signals
from django_dbqueue.schedules.scheduler import Scheduler


class Command(BaseCommand):
    help = "Fire the declared schedules' messages, once per slot however many schedulers run (SIGTERM/SIGINT stops)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="One pass: fire what is due now, print it, exit.")
        parser.add_argument("--database", default=None, help="Database alias (default: the queues' DATABASE).")
        parser.add_argument("--max-runtime", type=positive_float, help="Exit after this many seconds.")
        add_console_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        with command_console(options):
            self.schedule(options)

    def schedule(self, options: dict[str, Any]) -> None:
        scheduler = Scheduler(options["database"])
        try:
            if not scheduler.schedules():
                self.stderr.write(f"no schedules are declared for database {scheduler.using!r}")
            if options["once"]:
                self.stdout.write(str(scheduler.run_once()))
                return
        except DbQueueError as exc:
            raise CommandError(str(exc)) from exc
        names = sorted(spec.name for spec in scheduler.schedules())
        started = time.monotonic()
        # A second signal exits at once: a pass holds no lease, its transaction just rolls back.
        with stop_on_signals() as stop:
            log_banner(
                f"scheduler {scheduler.name}",
                scheduler.using,
                [f"  schedules    {', '.join(names) or 'none'}", "  stop with CONTROL-C or SIGTERM"],
                schedules=names,
            )
            scheduler.loop(stop, max_runtime=options["max_runtime"])
        elapsed = time.monotonic() - started
        log_summary(f"scheduler {scheduler.name} stops after {elapsed:.1f}s", elapsed=round(elapsed, 3))
