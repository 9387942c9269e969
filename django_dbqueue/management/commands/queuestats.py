"""``manage.py queuestats``: the admin's queue overview in a terminal (see django_dbqueue.overview)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbqueue.management.arguments import add_database_argument
from django_dbqueue.overview import as_table, build_overview


class Command(BaseCommand):
    help = "Per queue: ready, scheduled, in flight, dead, oldest ready age, acked and dead per hour; the workers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the overview as JSON (ages in seconds).")
        add_database_argument(parser, "The queue database to read")

    def handle(self, *args: Any, **options: Any) -> None:
        overview = build_overview(options["database"])
        if options["json"]:
            self.stdout.write(json.dumps(overview.as_json(), indent=2))
        else:
            self.stdout.write(as_table(overview))
