"""``manage.py runqueueworker``: a thin parser over `django_dbqueue.worker.QueueWorker`.

With ``--processes`` or ``--autoscale`` it runs a pool instead
(`django_dbqueue.worker.supervisor.Supervisor`), whose children are this
command again, told so by the hidden ``--pool-child-of`` and ``--pool-fd``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS

from django_dbqueue.db.errors import with_retries
from django_dbqueue.exceptions import DbQueueError
from django_dbqueue.management.arguments import (
    autoscale,
    non_negative_float,
    positive_float,
    positive_int,
    processes,
)
from django_dbqueue.management.console import add_console_arguments, command_console
from django_dbqueue.worker import QueueWorker, WorkerConfig
from django_dbqueue.worker.supervisor import PoolConfig, Supervisor


class Command(BaseCommand):
    help = "Run handlers for queued messages until stopped (SIGTERM/SIGINT: graceful; a second one: at once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="*", metavar="QUEUE", help="Queues to serve (default: every handled one).")
        parser.add_argument("--concurrency", type=positive_int, default=1, help="Handler threads (default 1).")
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Messages per claim (default: adaptive, as many as the handlers' recent durations allow, 1 to 20).",
        )
        parser.add_argument(
            "--async-concurrency",
            type=positive_int,
            default=100,
            metavar="N",
            help="async def handlers running at once on the process's event loop (default 100).",
        )
        parser.add_argument(
            "--async-timeout",
            type=positive_float,
            metavar="SECONDS",
            help="Cancel an async def handler running longer; the attempt fails (HandlerTimeout).",
        )
        parser.add_argument("--poll-interval", type=positive_float, help="First idle wait in seconds.")
        parser.add_argument("--max-poll-interval", type=positive_float, help="Longest idle wait in seconds.")
        parser.add_argument("--visibility-timeout", type=positive_float, help="Lease length in seconds.")
        parser.add_argument("--until-empty", action="store_true", help="Exit when no message is ready.")
        parser.add_argument("--max-messages", type=positive_int, help="Exit after this many messages.")
        parser.add_argument("--max-runtime", type=positive_float, help="Exit after this many seconds.")
        parser.add_argument("--grace", type=non_negative_float, help="Seconds running handlers get after a signal.")
        parser.add_argument("--exec", dest="exec_command", metavar="CMD", help="Run CMD per message, payload on stdin.")
        parser.add_argument(
            "--exec-timeout",
            type=positive_float,
            metavar="SECONDS",
            help="Kill an --exec command (and its process group) running longer; the attempt fails.",
        )
        parser.add_argument("--reap", action="store_true", help="Also run the reaper in this process.")
        parser.add_argument(
            "--no-schedules",
            dest="schedules",
            action="store_false",
            help="Do not fire schedules in this worker (by default every worker takes part).",
        )
        pool = parser.add_argument_group('a pool of processes (docs/workers.md, "A pool of processes")')
        pool.add_argument(
            "--processes",
            type=processes,
            metavar="N|auto",
            help="Run N worker processes (auto: one per CPU) under a supervisor, each with --concurrency threads.",
        )
        pool.add_argument(
            "--autoscale",
            type=autoscale,
            metavar="MIN,MAX",
            help="Run a pool of MIN to MAX processes: one more while messages wait, one fewer when idle.",
        )
        pool.add_argument(
            "--max-messages-per-child",
            type=positive_int,
            metavar="N",
            help="Replace a child after N messages (its replacement starts before it stops).",
        )
        pool.add_argument(
            "--max-memory-per-child",
            type=positive_float,
            metavar="MB",
            help="Replace a child whose resident memory passes MB megabytes, checked between messages.",
        )
        # A pool's child: its supervisor's row, and its end of the socket to it (worker/tether.py).
        parser.add_argument("--pool-child-of", metavar="NAME", help=argparse.SUPPRESS)
        parser.add_argument("--pool-fd", type=int, metavar="FD", help=argparse.SUPPRESS)
        add_console_arguments(parser)

    def check(self, *args: Any, **kwargs: Any) -> Any:
        """Django's system checks before the worker starts. They reach the database (a backend's checks of
        each field, once per process): an error there that can pass (a failover, a node cut off, a refused
        handshake) is tried again as every queue operation is (``TRANSIENT_RETRIES``), not the worker's end."""
        databases = kwargs.get("databases") or [DEFAULT_DB_ALIAS]
        checks = super().check
        return with_retries(databases[0], lambda: checks(*args, **kwargs), what="the system checks")

    def handle(self, *args: Any, **options: Any) -> None:
        is_pool = options["processes"] is not None or options["autoscale"] is not None
        if options["processes"] is not None and options["autoscale"] is not None:
            raise CommandError("give --processes N or --autoscale MIN,MAX, not both (an autoscaled pool starts at MIN)")
        is_child = options["pool_child_of"] is not None
        if is_child != (options["pool_fd"] is not None):
            raise CommandError("--pool-child-of and --pool-fd go together (a pool's supervisor gives them)")
        if is_pool and is_child:
            raise CommandError("a pool's child runs no pool of its own")
        recycling = options["max_messages_per_child"] is not None or options["max_memory_per_child"] is not None
        if recycling and not (is_pool or is_child):
            raise CommandError(
                "--max-messages-per-child and --max-memory-per-child recycle a pool's children: give --processes; "
                "a lone worker ends after --max-messages or --max-runtime instead"
            )
        if is_pool and options["max_messages"] is not None:
            raise CommandError(
                "--max-messages counts one process's messages: with a pool, use --max-messages-per-child"
            )
        handler = None
        if options["exec_command"] is not None:
            if not options["queues"]:
                raise CommandError("--exec needs the queues to serve named")
        elif options["exec_timeout"] is not None:
            raise CommandError("--exec-timeout applies to --exec commands only")
        if options["exec_command"] is not None:
            from django_dbqueue.execmode import ExecHandler

            try:
                handler = ExecHandler(options["exec_command"], timeout=options["exec_timeout"])
            except DbQueueError as exc:
                raise CommandError(str(exc)) from exc
        config = WorkerConfig(
            queues=options["queues"],
            concurrency=options["concurrency"],
            batch_size=options["batch_size"],
            async_concurrency=options["async_concurrency"],
            async_timeout=options["async_timeout"],
            poll_interval=options["poll_interval"],
            max_poll_interval=options["max_poll_interval"],
            visibility_timeout=options["visibility_timeout"],
            until_empty=options["until_empty"],
            max_messages=options["max_messages"],
            max_runtime=options["max_runtime"],
            grace=options["grace"],
            handler=handler,
            reap=options["reap"],
            schedules=options["schedules"],
            supervisor=options["pool_child_of"] or "",
            tether_fd=options["pool_fd"],
            max_messages_per_child=options["max_messages_per_child"] if is_child else None,
            max_memory_per_child=options["max_memory_per_child"] if is_child else None,
        )
        worker: QueueWorker | Supervisor
        try:
            if is_pool:
                low, high = options["autoscale"] or (options["processes"], None)
                pool = PoolConfig(
                    processes=low,
                    min_processes=low if high is not None else None,
                    max_processes=high,
                    max_messages_per_child=options["max_messages_per_child"],
                    max_memory_per_child=options["max_memory_per_child"],
                    verbosity=options["verbosity"],
                    json_logs=options["json_logs"],
                )
                worker = Supervisor(config, pool)
            else:
                worker = QueueWorker(config)
        except DbQueueError as exc:
            raise CommandError(str(exc)) from exc
        # Its own console unless the project's LOGGING takes django_dbqueue's records (docs/workers.md).
        with command_console(options):
            status = worker.run()
        sys.exit(int(status))
