"""``manage.py exportarchive``: a thin parser over :func:`django_dbqueue.analytics.export.export_archive`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.management.arguments import add_database_argument, positive_int, utc_datetime


class Command(BaseCommand):
    help = "Write the archive and the live backlog (without payloads) as Parquet, for queueanalytics --parquet-in."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", required=True, metavar="DIR", help="Directory for archive.parquet, live.parquet.")
        parser.add_argument("--since", type=utc_datetime, help="Only messages finished or created from then (UTC).")
        parser.add_argument("--until", type=utc_datetime, help="... and before then.")
        add_database_argument(parser, "The database to export")
        parser.add_argument("--chunk-size", type=positive_int, default=50_000, help="Rows per query and row group.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbqueue.analytics.session import MissingExtra, require

        since, until = options["since"], options["until"]
        if since and until and since >= until:
            raise CommandError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
        try:
            require("pyarrow")
        except MissingExtra as exc:
            raise CommandError(str(exc)) from exc
        from django_dbqueue.analytics.export import export_archive

        try:
            result = export_archive(
                options["out"], since=since, until=until, using=options["database"], chunk_size=options["chunk_size"]
            )
        except OSError as exc:
            raise CommandError(f"cannot write to --out {options['out']!r}: {exc}") from exc
        self.stdout.write(
            f"{result.archive_rows} archived rows to {result.archive_path}, "
            f"{result.live_rows} live rows to {result.live_path}"
        )
