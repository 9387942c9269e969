"""``manage.py queuestats``: the admin's queue overview in a terminal (see django_dbqueue.overview)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.overview import as_table, build_overview


class Command(BaseCommand):
    help = "Per queue: ready, scheduled, in flight, dead, oldest ready age, acked and dead per hour; the workers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the overview as JSON (ages in seconds).")
        parser.add_argument("--database", default=None, help="Database alias (default: the queues' DATABASE).")

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        if options["database"] is not None and options["database"] not in settings.DATABASES:
            raise CommandError(f"--database {options['database']!r} is not in DATABASES")
        overview = build_overview(options["database"])
        if options["json"]:
            self.stdout.write(json.dumps(overview.as_json(), indent=2))
        else:
            self.stdout.write(as_table(overview))
