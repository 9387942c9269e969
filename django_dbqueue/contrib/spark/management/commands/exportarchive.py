"""``manage.py exportarchive``: a thin parser over `django_dbqueue.contrib.spark.export.export_archive`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.management.arguments import (
    add_database_argument,
    non_negative_float,
    positive_int,
    utc_datetime,
)
from django_dbqueue.management.progress import command_progress


class Command(BaseCommand):
    help = "Write the archive and the live backlog (without payloads) as Parquet, for queueanalytics --parquet-in."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", required=True, metavar="DIR", help="Directory for archive.parquet, live.parquet.")
        parser.add_argument("--since", type=utc_datetime, help="Only messages finished or created from then (UTC).")
        parser.add_argument("--until", type=utc_datetime, help="... and before then.")
        add_database_argument(parser, "The database to export")
        parser.add_argument("--chunk-size", type=positive_int, default=50_000, help="Rows per query and row group.")
        parser.add_argument(
            "--incremental",
            action="store_true",
            help="Append the archive rows new since the last run as Parquet partitioned by day (finished_date=...).",
        )
        parser.add_argument(
            "--settle",
            type=non_negative_float,
            default=300.0,
            metavar="SECONDS",
            help="With --incremental: leave rows that finished less than this long ago for the next run.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbqueue.contrib.spark.session import MissingExtra, require

        since, until = options["since"], options["until"]
        if since and until and since >= until:
            raise CommandError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
        try:
            require("pyarrow")
        except MissingExtra as exc:
            raise CommandError(str(exc)) from exc
        if options["incremental"]:
            self._incremental(options)
            return
        from django_dbqueue.contrib.spark.export import export_archive

        try:
            result = export_archive(
                options["out"],
                since=since,
                until=until,
                using=options["database"],
                chunk_size=options["chunk_size"],
                progress=command_progress(self.stdout, options["verbosity"]),
            )
        except OSError as exc:
            raise CommandError(f"cannot write to --out {options['out']!r}: {exc}") from exc
        self.stdout.write(
            f"{result.archive_rows} archived rows to {result.archive_path}, "
            f"{result.live_rows} live rows to {result.live_path}"
        )

    def _incremental(self, options: dict[str, Any]) -> None:
        if options["since"] or options["until"]:
            raise CommandError("--incremental exports from its watermark on; it takes no --since or --until")
        from datetime import timedelta

        from django_dbqueue.contrib.spark.export import export_incremental

        try:
            result = export_incremental(
                options["out"],
                using=options["database"],
                settle=timedelta(seconds=options["settle"]),
                chunk_size=options["chunk_size"],
            )
        except OSError as exc:
            raise CommandError(f"cannot write to --out {options['out']!r}: {exc}") from exc
        if result.watermark is None:
            self.stdout.write(f"nothing new to export to {options['out']}")
            return
        finished_at, last_id = result.watermark
        self.stdout.write(
            f"{result.rows} archived rows to {options['out']} in {len(result.files)} file(s): "
            f"{', '.join(result.files)}; watermark {finished_at:%Y-%m-%d %H:%M:%S.%f} UTC, id {last_id}"
        )
