"""The long-running commands' own console, for projects that have not configured logging for django-dbqueue.

Django's ``runserver`` prints its requests without any ``LOGGING`` set up;
the queue's commands do the same here. `Console` adds a handler to
the ``django_dbqueue`` logger for the command's run only, and only when the
project set up no handler for its records (none on that logger, its
ancestors or the loggers below it): a project that configures logging keeps
full control, and nothing is printed twice.

What it prints follows ``--verbosity``: ``0`` errors only; ``1`` (the
default) the start-up banner, warnings and errors (a failed message, with
its error) and the summary on exit; ``2`` a line per finished message and
everything else at INFO; ``3`` DEBUG as well. ``--json-logs`` prints one JSON
object per line instead (`JsonFormatter`, which a project's own
``LOGGING`` can use too).

The commands' records say what they are through one ``extra`` attribute,
``dbqueue`` (see `event`): a dict with the event's name (``banner``,
``message``, ``summary``...) and its fields, which the JSON lines carry as
they are.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TextIO

LOGGER = "django_dbqueue"
MESSAGES = "django_dbqueue.messages"  # the worker's line per finished message
# Events shown at the default verbosity whatever their level: what the process is and how it ended.
ALWAYS = frozenset({"banner", "summary"})
JSON_LOGS_IGNORED = (
    "warning: --json-logs is ignored: the project's LOGGING sends django_dbqueue's records to its own handlers "
    '(give them the formatter {"()": "django_dbqueue.console.JsonFormatter"} for JSON lines; docs/workers.md)'
)


def event(name: str, **fields: Any) -> dict[str, Any]:
    """The ``extra=`` of a record that is a console event: ``logger.info(text, extra=event("summary", ...))``."""
    return {"dbqueue": {"event": name, **fields}}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "dbqueue", None)
    return fields if isinstance(fields, dict) else {}


def configured(logger: logging.Logger | None = None) -> bool:
    """Whether the project set up a handler for records of ``logger`` (``django_dbqueue``).

    One on the logger or an ancestor (the root), or on a logger below it
    (``django_dbqueue.messages``): that one's records would otherwise be
    printed twice, by the project's handler and, propagated, by the console.
    """
    logger = logger or logging.getLogger(LOGGER)
    if logger.hasHandlers():
        return True
    below = f"{logger.name}."
    loggers = list(logger.manager.loggerDict.items())  # a copy: another thread may add a logger meanwhile
    return any(
        name.startswith(below) and isinstance(child, logging.Logger) and child.handlers for name, child in loggers
    )


class ConsoleFilter(logging.Filter):
    """Lets through what ``verbosity`` shows (see the module's docstring)."""

    def __init__(self, verbosity: int) -> None:
        super().__init__()
        self.verbosity = verbosity

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbosity <= 0:
            return record.levelno >= logging.ERROR
        if self.verbosity == 1:
            return record.levelno >= logging.WARNING or fields_of(record).get("event") in ALWAYS
        if self.verbosity == 2:
            return record.levelno >= logging.INFO
        return True


class ConsoleFormatter(logging.Formatter):
    """``HH:MM:SS text``, the level named from WARNING up.

    A failed message's traceback is shown from ``-v 2`` on (its error's
    last line is in the text); any other record's traceback always.
    """

    def __init__(self, verbosity: int = 1) -> None:
        super().__init__()
        self.verbosity = verbosity

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        level = f"{record.levelname} " if record.levelno >= logging.WARNING else ""
        text = f"[{when}] {level}{record.getMessage()}"
        quiet = fields_of(record).get("event") == "message" and self.verbosity < 2
        if record.exc_info and record.exc_info[1] is not None and not quiet:
            text = f"{text}\n{''.join(traceback.format_exception(*record.exc_info)).rstrip()}"
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log shippers.

    Keys: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` (the
    text), the event's fields when the record is one (``event``, and for a
    message ``id``, ``queue``, ``kind``, ``outcome``, ``duration``...), and
    ``traceback`` when the record carries one. Usable in a project's
    ``LOGGING``: ``{"()": "django_dbqueue.console.JsonFormatter"}``.
    """

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            line.setdefault(key, value)
        if record.exc_info and record.exc_info[1] is not None:
            line["traceback"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(line, default=str)


class Console:
    """Around a command's run: its console, unless the project's logging takes the records.

    ``with Console(verbosity, json_logs=...) as console:``; ``console.active``
    says whether it prints. Outside the block the logger is as it was.
    Without a console, ``-v 2`` and ``-v 3`` still lower the logger's level
    to INFO and DEBUG, for the project's handlers, and ``json_logs`` is
    ignored, which it says once on the stream.
    """

    def __init__(self, verbosity: int = 1, *, json_logs: bool = False, stream: TextIO | None = None) -> None:
        self.verbosity = verbosity
        self.json_logs = json_logs
        self.stream = stream
        self.logger = logging.getLogger(LOGGER)
        self.messages = logging.getLogger(MESSAGES)
        self.handler: logging.Handler | None = None
        self._level = self.logger.level
        self._messages_level = self.messages.level

    @property
    def active(self) -> bool:
        return self.handler is not None

    def __enter__(self) -> Console:
        self._level = self.logger.level
        if self.verbosity >= 3:
            self.logger.setLevel(logging.DEBUG)
        elif self.verbosity >= 2:
            self.logger.setLevel(logging.INFO)
        if configured(self.logger):
            if self.json_logs:
                print(JSON_LOGS_IGNORED, file=self.stream or sys.stderr, flush=True)
            return self
        if self.verbosity < 3:
            self.logger.setLevel(logging.INFO)  # the banner and summary are INFO records
        self._messages_level = self.messages.level
        if self.verbosity < 2 and self.messages.level == logging.NOTSET:
            self.messages.setLevel(logging.WARNING)  # no record at all for each acked message at -v 1
        handler = logging.StreamHandler(self.stream or sys.stderr)
        handler.setFormatter(JsonFormatter() if self.json_logs else ConsoleFormatter(self.verbosity))
        handler.addFilter(ConsoleFilter(self.verbosity))
        self.logger.addHandler(handler)
        self.handler = handler
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.flush()
            self.handler = None
            self.messages.setLevel(self._messages_level)
        self.logger.setLevel(self._level)
