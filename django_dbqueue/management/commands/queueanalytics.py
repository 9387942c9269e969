"""``manage.py queueanalytics``: a thin parser over :class:`django_dbqueue.analytics.job.AnalyticsJob`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.exceptions import DbQueueError
from django_dbqueue.management.arguments import add_database_argument, positive_int, spark_master, utc_datetime


class Command(BaseCommand):
    help = "Compute per-hour queue figures from the archive with Spark and store them in QueueStat."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since", type=utc_datetime, help="Start (UTC unless an offset is given); default: 24 hours ago."
        )
        parser.add_argument("--until", type=utc_datetime, help="End, exclusive; default: now. Widened to whole hours.")
        parser.add_argument("--master", type=spark_master, default="local[*]", help="Spark master (default local[*]).")
        add_database_argument(parser, "The database to read, and to write QueueStat to")
        parser.add_argument("--parquet-in", metavar="DIR", help="Read a directory written by exportarchive instead.")
        parser.add_argument("--parquet-out", metavar="DIR", help="Also write the figures as Parquet, by hour.")
        parser.add_argument("--partitions", type=positive_int, help="JDBC read partitions (default: Spark's cores).")
        parser.add_argument(
            "--accuracy", type=positive_int, default=10_000, help="percentile_approx accuracy: rank error 1/accuracy."
        )
        parser.add_argument("--bench-rows", type=positive_int, help="Benchmark: time the job over N synthetic rows.")
        parser.add_argument("--repeat", type=positive_int, default=3, help="Benchmark runs (median reported).")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbqueue.analytics.session import MissingExtra, require

        try:
            require("pyspark")
        except MissingExtra as exc:
            raise CommandError(str(exc)) from exc
        if options["bench_rows"]:
            self._bench(options)
            return
        until = options["until"] or datetime.now(UTC)
        since = options["since"] or until - timedelta(hours=24)
        if since >= until:
            raise CommandError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
        from django_dbqueue.analytics.job import AnalyticsJob

        job = AnalyticsJob(
            since=since,
            until=until,
            using=options["database"],
            master=options["master"],
            parquet_in=options["parquet_in"],
            parquet_out=options["parquet_out"],
            partitions=options["partitions"],
            accuracy=options["accuracy"],
        )
        try:
            result = job.run()
        except DbQueueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(
            f"{result.window.since:%Y-%m-%d %H:%M} to {result.window.until:%Y-%m-%d %H:%M} UTC: "
            f"{result.rows_read} rows read, {result.stats_written} queue/kind/hour figures written "
            f"in {result.seconds:.1f} s ({result.rows_per_second:,.0f} rows/s)"
        )

    def _bench(self, options: dict[str, Any]) -> None:
        from django_dbqueue.analytics.bench import run_bench

        result = run_bench(
            options["bench_rows"],
            repeat=options["repeat"],
            master=options["master"],
            using=options["database"],
            partitions=options["partitions"],
        )
        runs = ", ".join(f"{s:.1f}" for s in result.runs)
        self.stdout.write(
            f"{result.rows} rows (filled in {result.fill_seconds:.0f} s); runs: {runs} s; "
            f"median {result.median_seconds:.1f} s = {result.rows_per_second:,.0f} rows/s"
        )
