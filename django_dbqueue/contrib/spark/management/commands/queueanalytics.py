"""``manage.py queueanalytics``: a thin parser over `django_dbqueue.contrib.spark.job.AnalyticsJob`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.exceptions import DbQueueError
from django_dbqueue.management.arguments import (
    add_database_argument,
    non_negative_float,
    positive_int,
    spark_master,
    utc_datetime,
)
from django_dbqueue.management.progress import command_progress


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
        parser.add_argument(
            "--incremental",
            action="store_true",
            help="Recompute only the hours that rows new since the last incremental run touched (a watermark).",
        )
        parser.add_argument(
            "--settle",
            type=non_negative_float,
            default=300.0,
            metavar="SECONDS",
            help="With --incremental: also look again at rows this much older than the watermark (late commits).",
        )
        parser.add_argument("--bench-rows", type=positive_int, help="Benchmark: time the job over N synthetic rows.")
        parser.add_argument("--repeat", type=positive_int, default=3, help="Benchmark runs (median reported).")
        parser.add_argument(
            "--bench-keep", action="store_true", help="Benchmark: keep the synthetic rows for the next benchmark."
        )
        parser.add_argument(
            "--bench-incremental",
            type=positive_int,
            metavar="NEW",
            help="Benchmark: time incremental runs, each after NEW rows were added to the N-row archive.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbqueue.contrib.spark.session import prerequisite_problems

        # Spark takes seconds to start and ends in a Java stack trace for want of Java or a driver:
        # say what is missing, and what provides it, first.
        try:
            missing = prerequisite_problems(None if options["parquet_in"] else options["database"])
        except DbQueueError as exc:
            raise CommandError(str(exc)) from exc
        if missing:
            raise CommandError("queueanalytics cannot start Spark:\n" + "\n".join(f"- {why}" for why in missing))
        if (options["bench_incremental"] or options["bench_keep"]) and not options["bench_rows"]:
            raise CommandError("--bench-incremental and --bench-keep go with --bench-rows N, the archive's size")
        if options["bench_rows"]:
            self._bench(options)
            return
        if options["incremental"]:
            self._incremental(options)
            return
        until = options["until"] or datetime.now(UTC)
        since = options["since"] or until - timedelta(hours=24)
        if since >= until:
            raise CommandError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
        from django_dbqueue.contrib.spark.job import AnalyticsJob

        job = AnalyticsJob(
            since=since,
            until=until,
            using=options["database"],
            master=options["master"],
            parquet_in=options["parquet_in"],
            parquet_out=options["parquet_out"],
            partitions=options["partitions"],
            accuracy=options["accuracy"],
            progress=command_progress(self.stdout, options["verbosity"]),
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

    def _incremental(self, options: dict[str, Any]) -> None:
        for name in ("since", "until", "parquet_in"):
            if options[name]:
                flag = "--" + name.replace("_", "-")
                raise CommandError(f"--incremental reads the database from its watermark on; it takes no {flag}")
        from django_dbqueue.contrib.spark.incremental import run_incremental
        from django_dbqueue.contrib.spark.job import AnalyticsJob

        job = AnalyticsJob(
            since=datetime.now(UTC),
            until=datetime.now(UTC),
            using=options["database"],
            master=options["master"],
            parquet_out=options["parquet_out"],
            partitions=options["partitions"],
            accuracy=options["accuracy"],
        )
        try:
            result = run_incremental(job, settle=timedelta(seconds=options["settle"]))
        except DbQueueError as exc:
            raise CommandError(str(exc)) from exc
        mark = (
            "none (the archive is empty)"
            if result.watermark is None
            else (f"{result.watermark.finished_at:%Y-%m-%d %H:%M:%S.%f} UTC, id {result.watermark.id}")
        )
        if result.job is None:
            self.stdout.write(f"nothing new; watermark {mark}")
            return
        self.stdout.write(
            f"{result.hours} hours recomputed ({result.job.window.since:%Y-%m-%d %H:%M} to "
            f"{result.job.window.until:%Y-%m-%d %H:%M} UTC): {result.job.rows_read} rows read, "
            f"{result.job.stats_written} queue/kind/hour figures written in {result.seconds:.1f} s; "
            f"watermark {mark}"
        )

    def _bench(self, options: dict[str, Any]) -> None:
        from django_dbqueue.contrib.spark.benchmark import BenchmarkRefused, run_bench, run_incremental_bench

        kwargs = {
            "repeat": options["repeat"],
            "master": options["master"],
            "using": options["database"],
            "partitions": options["partitions"],
            "keep": options["bench_keep"],
        }
        if options["bench_incremental"]:
            try:
                inc = run_incremental_bench(options["bench_rows"], options["bench_incremental"], **kwargs)
            except BenchmarkRefused as exc:
                raise CommandError(str(exc)) from exc
            runs = ", ".join(f"{s:.1f}" for s in inc.runs)
            self.stdout.write(
                f"{inc.rows} rows ({_filled(inc.fill_seconds)}), {inc.new_rows} new before each incremental run; "
                f"runs: {runs} s; median {inc.median_seconds:.1f} s; rows read: "
                f"{', '.join(map(str, inc.rows_read))}; hours recomputed: {', '.join(map(str, inc.hours))}"
            )
            return
        result = run_bench(options["bench_rows"], **kwargs)
        runs = ", ".join(f"{s:.1f}" for s in result.runs)
        self.stdout.write(
            f"{result.rows} rows ({_filled(result.fill_seconds)}); runs: {runs} s; "
            f"median {result.median_seconds:.1f} s = {result.rows_per_second:,.0f} rows/s"
        )


def _filled(seconds: float | None) -> str:
    return "kept from an earlier run" if seconds is None else f"filled in {seconds:.0f} s"
