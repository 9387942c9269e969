"""``manage.py queuebench``: a thin parser over `django_dbqueue.contrib.bench.runner.QueueBench`."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.contrib.bench.roles import HANDLERS, ROLES, run_role
from django_dbqueue.contrib.bench.runner import (
    DEFAULT_PHASES,
    PHASES,
    BenchConfig,
    QueueBench,
    as_json,
    as_table,
    bench_queues_on,
)
from django_dbqueue.management.arguments import add_database_argument, positive_int, row_count


class Command(BaseCommand):
    help = "Measure enqueue, drain, latency, claim latency and worker memory on this database, against raw SQL."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--messages", type=positive_int, default=10_000)
        parser.add_argument("--workers", type=positive_int, default=4, help="Worker processes for drain and latency.")
        parser.add_argument("--batch-size", type=positive_int, default=10)
        parser.add_argument("--payload-bytes", type=positive_int, default=100)
        add_database_argument(parser, "The database to measure")
        parser.add_argument(
            "--phases",
            default=",".join(DEFAULT_PHASES),
            help=f"Comma-separated, from: {', '.join(PHASES)} (soak, idle, async_io and workflows only when named).",
        )
        parser.add_argument("--rate", type=positive_int, default=200, help="Offered load of the latency phase (msg/s).")
        parser.add_argument("--latency-seconds", type=float, default=10.0)
        parser.add_argument("--archive-rows", type=row_count, default=100_000)
        parser.add_argument("--scheduled", type=positive_int, default=10_000)
        parser.add_argument("--memory-messages", type=positive_int, default=100_000)
        parser.add_argument(
            "--per-message-messages",
            type=positive_int,
            default=2_000,
            help="Messages of the per_message phase (one default worker against the raw per-message loop).",
        )
        parser.add_argument(
            "--peers-messages",
            type=positive_int,
            default=5_000,
            help="Jobs of the peers phase (default workers with one-row jobs against one transaction per message).",
        )
        parser.add_argument(
            "--peers-concurrency",
            type=positive_int,
            help="Handler threads of the peers phase's default workers (default: runqueueworker's, 1).",
        )
        parser.add_argument(
            "--fairness-messages",
            type=positive_int,
            default=400,
            help="Jobs of the fairness phase (one of 2 s among every 100 of 1 ms; at least 100).",
        )
        parser.add_argument(
            "--soak-messages",
            type=positive_int,
            default=1_000_000,
            help="Messages of the soak phase (enqueued and drained continuously).",
        )
        parser.add_argument(
            "--idle-seconds", type=float, default=10.0, help="How long the idle phase watches an idle worker's CPU."
        )
        parser.add_argument(
            "--cpu-messages",
            type=positive_int,
            default=400,
            help="Messages of the cpu_bound phase (20 ms of pure Python each).",
        )
        parser.add_argument(
            "--io-messages",
            type=positive_int,
            default=2_000,
            help="Messages of the async_io phase (100 ms of simulated I/O each).",
        )
        parser.add_argument(
            "--history-rows",
            type=row_count,
            default=1_000_000,
            help="The archive phase: archived rows, spread over --history-days days.",
        )
        parser.add_argument(
            "--history-days",
            type=positive_int,
            default=60,
            help="The archive phase: days of history; retention keeps the newer half.",
        )
        parser.add_argument("--repeat", type=positive_int, default=1, help="Runs of every phase; medians reported.")
        parser.add_argument(
            "--no-nudges",
            action="store_true",
            help="Workers wait for their poll only: no wake-up datagrams after an enqueue (MySQL/MariaDB, SQLite).",
        )
        parser.add_argument("--json", action="store_true", help="Print the results as JSON.")
        # Internal: what the benchmark's own child processes run.
        parser.add_argument("--role", choices=sorted(ROLES), help="(internal)")
        parser.add_argument("--queue", help="(internal)")
        parser.add_argument("--forever", action="store_true", help="(internal)")
        parser.add_argument("--max-runtime", type=float, help="(internal)")
        parser.add_argument("--handler", choices=sorted(HANDLERS), default="noop", help="(internal)")
        parser.add_argument("--report", help="(internal) where a child writes its CPU time")
        parser.add_argument("--concurrency", type=positive_int, help="(internal) a default worker's threads")

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        if options["role"]:
            with bench_queues_on(options["database"], nudges=not options["no_nudges"]):
                run_role(
                    options["role"],
                    options["queue"],
                    options["batch_size"],
                    not options["forever"],
                    options["max_runtime"],
                    database=options["database"],
                    handler=options["handler"],
                    report=options["report"],
                    concurrency=options["concurrency"],
                )
            return
        phases = tuple(p.strip() for p in options["phases"].split(",") if p.strip())
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise CommandError(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}")
        config = BenchConfig(
            messages=options["messages"],
            workers=options["workers"],
            batch_size=options["batch_size"],
            payload_bytes=options["payload_bytes"],
            database=options["database"],
            phases=phases,
            rate=options["rate"],
            latency_seconds=options["latency_seconds"],
            archive_rows=options["archive_rows"],
            scheduled=options["scheduled"],
            memory_messages=options["memory_messages"],
            per_message_messages=options["per_message_messages"],
            peers_messages=options["peers_messages"],
            peers_concurrency=options["peers_concurrency"],
            fairness_messages=options["fairness_messages"],
            repeat=options["repeat"],
            soak_messages=options["soak_messages"],
            idle_seconds=options["idle_seconds"],
            nudges=not options["no_nudges"],
            cpu_messages=options["cpu_messages"],
            io_messages=options["io_messages"],
            history_rows=options["history_rows"],
            history_days=options["history_days"],
        )
        if config.history_days < 2:
            raise CommandError("--history-days must be at least 2: the archive phase keeps the newer half")
        if config.idle_seconds <= 0:
            raise CommandError("--idle-seconds must be positive")
        if settings.DEBUG:
            self.stderr.write(
                "warning: DEBUG is on, so Django records every ORM query (the raw-SQL side bypasses that); "
                "run with DEBUG off to compare like with like"
            )
        results = QueueBench(config, progress=self.stderr).run()
        if options["json"]:
            self.stdout.write(json.dumps(as_json(results, config), indent=2, default=str))
        else:
            self.stdout.write(as_table(results, config))
