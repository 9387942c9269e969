"""The one ``--json-logs`` argument and the console of the long-running commands (see `django_dbqueue.console`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.core.management.base import CommandParser

from .._version import __version__
from ..console import Console, event
from ..db import describe

logger = logging.getLogger("django_dbqueue")


def add_console_arguments(parser: CommandParser) -> None:
    parser.add_argument(
        "--json-logs",
        action="store_true",
        help="Print the console's lines as JSON objects, one a line. Ignored, with a warning, when the "
        "project's LOGGING configures django_dbqueue: its handlers print the records (docs/workers.md).",
    )


def command_console(options: dict[str, Any]) -> Console:
    """The console for a command's run, from its ``--verbosity`` and ``--json-logs``."""
    return Console(options["verbosity"], json_logs=options["json_logs"])


def log_banner(what: str, using: str, lines: Iterable[str] = (), **fields: Any) -> None:
    """A command's start-up banner: what runs, on which database, and ``lines`` more (shown at ``-v 1``)."""
    database = describe(using)
    text = "\n".join([f"django-dbqueue {__version__} {what}", f"  database     {using} ({database})", *lines])
    logger.info("%s", text, extra=event("banner", version=__version__, database=using, vendor=database, **fields))


def log_summary(text: str, **fields: Any) -> None:
    """A command's line on exit (shown at ``-v 1``)."""
    logger.info("%s", text, extra=event("summary", **fields))
