"""``manage.py partitionarchive``: a thin parser over `django_dbqueue.models.partitions.ArchiveLayout`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.conf import get_settings
from django_dbqueue.db.partitions import PartitioningUnsupported
from django_dbqueue.exceptions import InvalidOption
from django_dbqueue.management.arguments import add_database_argument, positive_int
from django_dbqueue.management.progress import command_progress
from django_dbqueue.models.partitions import DEFAULT_CHUNK, ArchiveLayout


class Command(BaseCommand):
    help = (
        "Convert the archive to the partitioned layout of ARCHIVE_PARTITIONS (or back to one table with "
        "--rollback) while the queue runs; run it again to resume a conversion that was stopped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Print the plan and change nothing.")
        parser.add_argument(
            "--rollback", action="store_true", help="Convert a partitioned archive back to one plain table."
        )
        parser.add_argument(
            "--chunk-size",
            type=positive_int,
            default=DEFAULT_CHUNK,
            help=f"Ids of old rows copied per statement (default: {DEFAULT_CHUNK}).",
        )
        add_database_argument(parser, "The database whose archive to convert")

    def handle(self, *args: Any, **options: Any) -> None:
        target = None if options["rollback"] else get_settings().archive_partitions
        if target is None and not options["rollback"]:
            raise CommandError(
                "DBQUEUE's ARCHIVE_PARTITIONS is None: set it to 'daily' or 'weekly' to partition the archive, "
                "or pass --rollback to make a partitioned archive one table again (docs/archive.md)"
            )
        layout = ArchiveLayout(options["database"])
        try:
            plan = layout.plan(target)
            self.stdout.write(str(plan))
            if options["dry_run"] or plan.nothing_to_do:
                return
            progress = command_progress(self.stdout, options["verbosity"])
            progress.start("copying the old rows", total=plan.rows_to_copy)
            try:
                copied = layout.convert(target, options["chunk_size"], on_chunk=progress.advance)
            finally:
                progress.finish(keep=False)
        except (InvalidOption, PartitioningUnsupported) as exc:
            raise CommandError(str(exc)) from exc
        partitioned = layout.partitioned()  # a run resumes the conversion under way, whichever was asked
        kind = f"partitioned ({len(layout.partitions())} partitions)" if partitioned else "one plain table"
        self.stdout.write(f"done: {copied:,} old row(s) copied; the archive is {kind}")
