"""``manage.py queuestats``: the admin's queue overview in a terminal (see django_dbqueue.overview)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbqueue.management.arguments import add_database_argument
from django_dbqueue.overview import as_table, build_overview, schedules_table
from django_dbqueue.schedules.status import schedule_statuses


class Command(BaseCommand):
    help = (
        "Per queue: ready, scheduled, in flight, dead, oldest ready age, acked and dead per hour; "
        "the workers; the schedules."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the overview as JSON (ages in seconds).")
        add_database_argument(parser, "The queue database to read")

    def handle(self, *args: Any, **options: Any) -> None:
        overview = build_overview(options["database"])
        schedules = schedule_statuses(options["database"])
        if options["json"]:
            data = {**overview.as_json(), "schedules": [status.as_json() for status in schedules]}
            self.stdout.write(json.dumps(data, indent=2))
        else:
            self.stdout.write(as_table(overview))
            if schedules:  # a project without schedules sees no empty section
                self.stdout.write(schedules_table(schedules))
