"""Argument types shared by the management commands: bad values fail with argparse's own message."""

from __future__ import annotations

import math
import os
import re
from argparse import ArgumentParser, ArgumentTypeError
from datetime import UTC, datetime

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from django.utils.dateparse import parse_date, parse_datetime

from ..conf import database_for
from ..exceptions import ImproperlyConfiguredQueue
from ..validation import MAX_DELAY_SECONDS

# The largest count and the longest duration an option accepts: past them a
# value is a typo, and a duration would overflow the database's timestamps.
MAX_COUNT = 10_000_000
MAX_SECONDS = MAX_DELAY_SECONDS
# Rows of a table (the benchmark's history, a year at millions a day): larger than any one batch of work.
MAX_ROWS = 1_000_000_000


def positive_int(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_COUNT:
        raise ValueError(text)  # argparse says: invalid positive_int value: '0'
    return value


def row_count(text: str) -> int:
    """A count of rows a table holds: up to ``MAX_ROWS``."""
    value = int(text)
    if not 1 <= value <= MAX_ROWS:
        raise ValueError(text)  # argparse says: invalid row_count value: '0'
    return value


def _seconds(text: str, *, zero: bool) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero) or value > MAX_SECONDS:
        raise ValueError(text)  # argparse says: invalid positive_float value: 'nan'
    return value


def positive_float(text: str) -> float:
    return _seconds(text, zero=False)


def non_negative_float(text: str) -> float:
    return _seconds(text, zero=True)


# The most children a pool may have: past it a value is a typo (and each child holds connections).
MAX_PROCESSES = 1024


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, as a container's cpuset limits it), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def processes(text: str) -> int:
    """``--processes``: a count of child processes, or ``auto``, one per CPU."""
    if text == "auto":
        return cpu_count()
    value = int(text)
    if not 1 <= value <= MAX_PROCESSES:
        raise ValueError(text)  # argparse says: invalid processes value: '0'
    return value


def autoscale(text: str) -> tuple[int, int]:
    """``--autoscale MIN,MAX``: the bounds of an autoscaled pool, 1 <= MIN <= MAX."""
    low, comma, high = text.partition(",")
    try:
        bounds = (int(low), int(high)) if comma else None
    except ValueError:
        bounds = None
    if bounds is None or not 1 <= bounds[0] <= bounds[1] <= MAX_PROCESSES:
        swapped = " (Celery writes MAX,MIN; here the smaller comes first)" if bounds and bounds[0] > bounds[1] else ""
        raise ArgumentTypeError(
            f"{text!r} is not MIN,MAX: two whole numbers of processes, 1 <= MIN <= MAX <= {MAX_PROCESSES} "
            f"(such as 2,8){swapped}"
        )
    return bounds


def utc_datetime(text: str) -> datetime:
    """A date or ISO 8601 datetime; without an offset it is taken as UTC."""
    problem = f"{text!r} is not a date or datetime; write YYYY-MM-DD or YYYY-MM-DDTHH:MM[:SS][+HH:MM]"
    try:
        value = parse_datetime(text)
        day = parse_date(text) if value is None else None
    except ValueError as exc:  # well formed, but no such day or time
        raise ArgumentTypeError(f"{problem} ({exc})") from exc
    if value is None:
        if day is None:
            raise ArgumentTypeError(problem)
        value = datetime(day.year, day.month, day.day)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


SPARK_MASTER = re.compile(r"^(local(\[(\*|[1-9]\d*)(,[1-9]\d*)?\])?|yarn|(spark|k8s|mesos)://\S+)$")


def spark_master(text: str) -> str:
    """A Spark master URL: local, local[N], local[*], spark://host:port, yarn, k8s://..."""
    if not SPARK_MASTER.match(text):
        raise ArgumentTypeError(
            f"{text!r} is not a Spark master; use local[*], local[N], spark://host:port, yarn or k8s://https://host"
        )
    return text


def database_alias(text: str) -> str:
    """An alias of ``DATABASES``."""
    if text not in settings.DATABASES:
        raise ArgumentTypeError(f"--database {text!r} is not in DATABASES")
    return text


def queues_database() -> str:
    """The queues' default database: the top-level ``DATABASE`` of the DBQUEUE setting."""
    try:
        return database_for([])
    except ImproperlyConfiguredQueue:  # the system check (E001) names the problem before the command runs
        return DEFAULT_DB_ALIAS


def add_database_argument(parser: ArgumentParser, what: str) -> None:
    """``--database ALIAS`` for every command that works on one database, with one default.

    The default is the queues' database (DBQUEUE's ``DATABASE``, ``"default"``
    unless set), so a project that keeps its queues elsewhere names it once,
    in settings. ``what`` says what the command does with it.
    """
    parser.add_argument(
        "--database",
        type=database_alias,
        default=queues_database(),
        metavar="ALIAS",
        help=f"{what} (default: DBQUEUE's DATABASE, %(default)r).",
    )
