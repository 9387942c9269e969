"""The one place where django-dbqueue reads its settings.

Everything lives in a single ``DBQUEUE`` dict in the project's settings.
Top-level keys are defaults; ``QUEUES`` overrides them per queue::

    DBQUEUE = {
        "VISIBILITY_TIMEOUT": 300,
        "QUEUES": {"emails": {"MAX_ATTEMPTS": 10}},
    }

The rest of the app asks `get_settings` (global values) or
`queue_options` (one queue's effective values) and never reads
``django.conf.settings`` itself. Problems are reported by the system check
``django_dbqueue.E001`` and by `ImproperlyConfiguredQueue` at use.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .exceptions import ImproperlyConfiguredQueue, InvalidOption
from .validation import MAX_DELAY_SECONDS

# Upper bounds of the settings that are durations, in seconds: a value past
# them is a typo (minutes for seconds) or would overflow a timestamp.
HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY


def _number(minimum: float, maximum: float | None = None, *, allow_none: bool = False) -> Callable[[Any], str | None]:
    """A finite number in [minimum, maximum]: NaN and infinity are refused, like values past the maximum."""

    def check(value: Any) -> str | None:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, not {type(value).__name__}"
        if not math.isfinite(value):
            return f"must be a finite number, not {value!r}"
        if value < minimum:
            return f"must be >= {minimum}, not {value!r}"
        if maximum is not None and value > maximum:
            return f"must be <= {maximum:g}, not {value!r}"
        return None

    return check


def _fraction(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, not {type(value).__name__}"
    return None if 0 <= value <= 1 else f"must be between 0 and 1 (a fraction of the delay), not {value!r}"


def _integer(minimum: int, maximum: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, not {type(value).__name__}"
        if value < minimum:
            return f"must be >= {minimum}, not {value!r}"
        if maximum is not None and value > maximum:
            return f"must be <= {maximum}, not {value!r}"
        return None

    return check


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be True or False, not {value!r}"


def _nudge_host(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value and value == value.strip() and len(value) <= 255):
        return None
    return f"must be the address workers bind their wake-up socket to (such as '127.0.0.1') or None, not {value!r}"


def _choice(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))}, not {value!r}"

    return check


def _optional_choice(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None or value in choices:
            return None
        return f"must be one of {', '.join(map(repr, choices))} or None, not {value!r}"

    return check


def _optional_integer(minimum: int, maximum: int) -> Callable[[Any], str | None]:
    check = _integer(minimum, maximum)
    return lambda value: None if value is None else check(value)


def _kind_limits(value: Any) -> str | None:
    """``{"kind": n}``: per-kind overrides of GROUP_CONCURRENCY."""
    if not isinstance(value, dict):
        return f'must be a dict of kind to a limit, like {{"export": 1}}, not {value!r}'
    for kind, limit in value.items():
        if not isinstance(kind, str):
            return f"must have kind names (strings) as keys, not {kind!r}"
        if (why := _integer(1, 10_000)(limit)) is not None:
            return f"[{kind!r}] {why}"
    return None


@dataclass(frozen=True)
class RateLimit:
    """``RATE_LIMIT`` parsed: at most ``count`` claims in any ``seconds`` (per group when ``per_group``)."""

    count: int
    seconds: float
    per_group: bool

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}[self.seconds]
        return f"{self.count}/{unit}" + (" per group" if self.per_group else "")


RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
# Each allowed claim is a row (a slot) the database locks: the limit bounds that table.
RATE_MAX_COUNT = 10_000
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*(per group)?\s*$")


def parse_rate_limit(value: Any) -> RateLimit | None:
    """``"100/s"``, ``"20/m"``, ``"5/s per group"`` as a RateLimit; None stays None; InvalidOption otherwise."""
    if value is None:
        return None
    found = _RATE.match(value) if isinstance(value, str) else None
    if found is None:
        raise InvalidOption(f'must be a rate such as "100/s", "20/m", "1000/h" or "5/s per group", not {value!r}')
    count = int(found.group(1))
    if not 1 <= count <= RATE_MAX_COUNT:
        raise InvalidOption(f"must allow between 1 and {RATE_MAX_COUNT} claims per period, not {count}")
    return RateLimit(count, RATE_UNITS[found.group(2)], found.group(3) is not None)


def _rate_limit(value: Any) -> str | None:
    try:
        parse_rate_limit(value)
    except InvalidOption as exc:
        return str(exc)
    return None


def _alias(value: Any) -> str | None:
    if value not in settings.DATABASES:
        return f"names no database in DATABASES: {value!r}"
    return None


def _pooled_databases(value: Any) -> str | None:
    """``{"alias": "direct alias" or None}``: databases behind a transaction pooler, and where their LISTEN goes."""
    if not isinstance(value, dict):
        return f"must be a dict of database aliases, got {type(value).__name__}"
    for alias, direct in value.items():
        for name in (alias, direct):
            if name is not None and name not in settings.DATABASES:
                return f"names no database in DATABASES: {name!r}"
        if direct is not None and direct in value:
            return f"{alias!r} listens through {direct!r}, which is pooled itself: LISTEN needs a direct connection"
    return None


def _topics(value: Any) -> str | None:
    """``{"topic": ["queue", ...]}``: each topic's subscriber queues."""
    from .validation import queue_name_problem

    if not isinstance(value, dict):
        return f'must be a dict of topic name to a list of queue names, like {{"orders": ["email"]}}, not {value!r}'
    for topic, queues in value.items():
        if (why := queue_name_problem(topic, "topic")) is not None:
            return f"has a bad topic name: {why}"
        if not isinstance(queues, list | tuple):
            return f"topic {topic!r} must have a list of queue names, not {type(queues).__name__}"
        for queue in queues:
            if (why := queue_name_problem(queue)) is not None:
                return f"topic {topic!r} has a bad queue name: {why}"
        if len(set(queues)) != len(queues):
            return f"topic {topic!r} names a queue twice: {list(queues)!r}"
    return None


# Keys that may be set globally and overridden per queue: (default, validator).
QUEUE_KEYS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    "DATABASE": ("default", _alias),
    "VISIBILITY_TIMEOUT": (300, _number(0.1, WEEK)),
    # The attempts column holds up to 32767, like a message's own max_attempts.
    "MAX_ATTEMPTS": (5, _integer(1, 32767)),
    "BACKOFF_BASE": (2.0, _number(0, MAX_DELAY_SECONDS)),
    "BACKOFF_MAX": (3600.0, _number(0, MAX_DELAY_SECONDS)),
    "BACKOFF_JITTER": (0.2, _fraction),
    # How often one message may be put off (Defer, snooze) before it is
    # dead-lettered: a handler that always defers would otherwise run for ever.
    "MAX_DEFERRALS": (100, _integer(0, 2_147_483_647)),
    "ARCHIVE": (True, _boolean),
    "RETENTION_DAYS": (30, _number(0, 36500, allow_none=True)),
    "UNHANDLED": ("dead", _choice("dead", "keep")),
    # Flow control (docs/flow-control.md): at most this many messages of one
    # group in flight (None: no limit), with per-kind overrides; one at a time
    # and in enqueue order per group; at most so many claims per period.
    "GROUP_CONCURRENCY": (None, _optional_integer(1, 10_000)),
    "KIND_GROUP_CONCURRENCY": ({}, _kind_limits),
    "ORDERED": (False, _boolean),
    "RATE_LIMIT": (None, _rate_limit),
}

# Keys that only make sense globally.
GLOBAL_KEYS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    "TRANSIENT_RETRIES": (5, _integer(0, 100)),
    "ENQUEUE_BATCH_SIZE": (500, _integer(1, 10_000)),
    # A worker writes its heartbeat (and extends the leases of what it runs)
    # this often; the reaper treats it as dead after WORKER_STALE_AFTER
    # seconds of silence and gives its messages back.
    "HEARTBEAT_INTERVAL": (2.0, _number(0.1, HOUR)),
    "WORKER_STALE_AFTER": (8.0, _number(1, DAY)),
    "POLL_INTERVAL": (0.1, _number(0.01, HOUR)),
    "MAX_POLL_INTERVAL": (2.0, _number(0.01, HOUR)),
    "SHUTDOWN_GRACE": (30.0, _number(0, DAY)),
    "LOG_INTERVAL": (60.0, _number(1, DAY)),
    "REAP_INTERVAL": (2.0, _number(0.1, DAY)),
    "REAP_BATCH_SIZE": (1000, _integer(1, 100_000)),
    # Schedules (docs/schedules.md): the longest a scheduler sleeps between passes
    # (it wakes sooner for a slot), and how long the record of each firing is kept.
    "SCHEDULER_INTERVAL": (5.0, _number(0.1, HOUR)),
    "SCHEDULE_RETENTION_DAYS": (7, _number(0, 36500, allow_none=True)),
    # An autoscaled pool (runqueueworker --autoscale; docs/workers.md, "Autoscaling"): it grows
    # when a queue's next message has waited AUTOSCALE_WAIT seconds, shrinks after AUTOSCALE_IDLE
    # seconds with one child's capacity unused, and reads its backlog every AUTOSCALE_INTERVAL.
    "AUTOSCALE_WAIT": (2.0, _number(0.1, DAY)),
    "AUTOSCALE_IDLE": (30.0, _number(1, DAY)),
    "AUTOSCALE_INTERVAL": (1.0, _number(0.1, HOUR)),
    # Topics and the queues subscribed to them, beside the Subscription table.
    "TOPICS": ({}, _topics),
    # "immediate": every enqueued message runs in the enqueuing process once
    # its transaction commits, for tests (docs/testing.md); "worker": workers run them.
    "MODE": ("worker", _choice("worker", "immediate")),
    # Count what each process does for Prometheus (the extra "metrics"; docs/metrics.md).
    "METRICS": (False, _boolean),
    # OpenTelemetry spans and trace context in headers (the extra "otel"; docs/tracing.md).
    "TRACING": (False, _boolean),
    # Where there is no LISTEN/NOTIFY (MySQL/MariaDB, SQLite), each worker binds a
    # UDP socket here and an enqueue nudges the idle workers of its queue
    # (docs/workers.md, "Waking idle workers"); None: workers only poll.
    "NUDGE_HOST": ("127.0.0.1", _nudge_host),
    # PostgreSQL databases reached through a pooler in transaction mode (PgBouncer), each
    # with the alias of a direct connection to the same database for LISTEN, or None:
    # LISTEN on a pooled connection loses its notifications, so workers there poll
    # (docs/high-availability.md, "PgBouncer in transaction pooling").
    "POOLED_DATABASES": ({}, _pooled_databases),
    # The archive partitioned by finish time, a partition a day or an ISO week in
    # TIME_ZONE (docs/archive.md); None: one plain table. MariaDB/MySQL and PostgreSQL.
    "ARCHIVE_PARTITIONS": (None, _optional_choice("daily", "weekly")),
}


# Keys of the DBQUEUE dict that a contrib app reads and checks itself: the
# core leaves them alone (docs/settings.md lists them with their app).
CONTRIB_KEYS = {"SPARK_JARS": "django_dbqueue.contrib.spark"}


@dataclass(frozen=True)
class QueueOptions:
    """The effective settings of one queue."""

    database: str
    visibility_timeout: float
    max_attempts: int
    backoff_base: float
    backoff_max: float
    backoff_jitter: float
    max_deferrals: int
    archive: bool
    retention_days: float | None
    unhandled: str
    group_concurrency: int | None = None
    kind_group_concurrency: dict[str, int] = field(default_factory=dict)
    ordered: bool = False
    rate_limit: RateLimit | None = None

    @property
    def flow_controlled(self) -> bool:
        """Whether a claim on this queue goes through flow control (groups, order, rate)."""
        return bool(self.ordered or self.group_concurrency or self.kind_group_concurrency or self.rate_limit)

    def group_limit(self, kind: str) -> int | None:
        """How many messages of one group (and of ``kind``, when it has its own limit) may be in flight."""
        return self.kind_group_concurrency.get(kind, self.group_concurrency)


@dataclass(frozen=True)
class DbQueueSettings:
    """The whole ``DBQUEUE`` setting, validated, with defaults filled in."""

    transient_retries: int
    enqueue_batch_size: int
    heartbeat_interval: float
    worker_stale_after: float
    poll_interval: float
    max_poll_interval: float
    shutdown_grace: float
    log_interval: float
    reap_interval: float
    reap_batch_size: int
    scheduler_interval: float
    schedule_retention_days: float | None
    autoscale_wait: float
    autoscale_idle: float
    autoscale_interval: float
    topics: dict[str, list[str]]
    mode: str
    metrics: bool
    tracing: bool
    nudge_host: str | None
    pooled_databases: dict[str, str | None]
    archive_partitions: str | None
    defaults: QueueOptions
    queues: dict[str, QueueOptions] = field(default_factory=dict)
    # DBQUEUE["SCHEDULES"], checked: name -> ScheduleSpec (django_dbqueue.schedules.spec).
    schedules: dict[str, Any] = field(default_factory=dict)

    def for_queue(self, queue: str) -> QueueOptions:
        return self.queues.get(queue, self.defaults)


def raw_setting() -> Any:
    return getattr(settings, "DBQUEUE", {})


def unknown_key(where: str, key: object, known: Iterable[str], label: str = "known keys") -> str:
    """The sentence for an unknown key: the nearest known one first ("did you mean"), then them all."""
    known = sorted(known)
    close = difflib.get_close_matches(str(key).upper(), known, n=1, cutoff=0.6) if isinstance(key, str) else []
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where} has an unknown key {key!r}{guess} ({label}: {', '.join(known)})"


def misspelled_setting_names() -> list[str]:
    """Settings whose names look like ``DBQUEUE`` but are not (``DBQUEUES``, ``DB_QUEUE``...): ignored otherwise.

    A name counts when, without underscores, it contains ``DBQUEUE`` or
    starts with ``DB`` and is within a letter or two of it.
    """
    found = []
    for name in dir(settings):
        if not name.isupper() or name == "DBQUEUE":
            continue
        squeezed = name.replace("_", "")
        if "DBQUEUE" in squeezed or (
            squeezed.startswith("DB") and difflib.SequenceMatcher(None, squeezed, "DBQUEUE").ratio() >= 0.85
        ):
            found.append(name)
    return sorted(found)


def find_problems(raw: Any) -> list[str]:
    """Return a sentence for each problem in a ``DBQUEUE`` value (empty if fine)."""
    if not isinstance(raw, dict):
        return [f"DBQUEUE must be a dict, not {type(raw).__name__}"]
    problems = []
    for key, value in raw.items():
        if key in ("QUEUES", "SCHEDULES") or key in CONTRIB_KEYS:
            continue
        spec = QUEUE_KEYS.get(key) or GLOBAL_KEYS.get(key)
        if spec is None:
            known = [*QUEUE_KEYS, *GLOBAL_KEYS, *CONTRIB_KEYS, "QUEUES", "SCHEDULES"]
            problems.append(unknown_key("DBQUEUE", key, known))
        elif (why := spec[1](value)) is not None:
            problems.append(f"DBQUEUE[{key!r}] {why}")
    heartbeat = raw.get("HEARTBEAT_INTERVAL", GLOBAL_KEYS["HEARTBEAT_INTERVAL"][0])
    stale = raw.get("WORKER_STALE_AFTER", GLOBAL_KEYS["WORKER_STALE_AFTER"][0])
    if not problems and stale <= 2 * heartbeat:
        problems.append(
            f"DBQUEUE['WORKER_STALE_AFTER'] ({stale}) must be more than twice HEARTBEAT_INTERVAL ({heartbeat}), "
            "or live workers would be taken for dead"
        )
    problems += schedule_problems(raw.get("SCHEDULES", {}))
    problems += _flow_problems("DBQUEUE", raw)
    queues = raw.get("QUEUES", {})
    if not isinstance(queues, dict):
        return [*problems, f"DBQUEUE['QUEUES'] must be a dict of queue name to options, not {type(queues).__name__}"]
    from .validation import queue_name_problem

    for name, options in queues.items():
        if (why := queue_name_problem(name)) is not None:
            problems.append(f"DBQUEUE['QUEUES'] has a bad queue name: {why}")
        if not isinstance(options, dict):
            problems.append(f"DBQUEUE['QUEUES'][{name!r}] must be a dict, not {type(options).__name__}")
            continue
        for key, value in options.items():
            spec = QUEUE_KEYS.get(key)
            if spec is None:
                problems.append(unknown_key(f"DBQUEUE['QUEUES'][{name!r}]", key, QUEUE_KEYS, "per-queue keys"))
            elif (why := spec[1](value)) is not None:
                problems.append(f"DBQUEUE['QUEUES'][{name!r}][{key!r}] {why}")
        problems += _flow_problems(f"DBQUEUE['QUEUES'][{name!r}]", {**raw, **options})
    return problems


def _flow_problems(where: str, values: dict[str, Any]) -> list[str]:
    """ORDERED already runs one message of a group at a time: a concurrency limit beside it contradicts it."""
    if values.get("ORDERED") is True and (values.get("GROUP_CONCURRENCY") or values.get("KIND_GROUP_CONCURRENCY")):
        return [f"{where} sets ORDERED with GROUP_CONCURRENCY or KIND_GROUP_CONCURRENCY; ORDERED runs one at a time"]
    return []


# --- SCHEDULES -----------------------------------------------------------------
#
# ``DBQUEUE["SCHEDULES"] = {"name": {"CRON": "*/5 * * * *", "QUEUE": "reports", ...}}``:
# the keys are the fields of ``@django_dbqueue.schedule`` in capitals. The
# checks themselves live in django_dbqueue.schedules.spec, shared with the decorator.


def django_time_zone() -> str:
    """Django's TIME_ZONE ("UTC" when unset): where the archive's partitions start their days."""
    return getattr(settings, "TIME_ZONE", None) or "UTC"


def schedule_timezone() -> str:
    """The time zone a cron schedule reads its expression in when it names none: Django's TIME_ZONE."""
    return django_time_zone()


def schedule_specs(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """The SCHEDULES setting as specs, and a sentence naming the schedule and field of each problem."""
    from .schedules.spec import build_spec

    if not isinstance(raw, dict):
        return {}, [f"DBQUEUE['SCHEDULES'] must be a dict of schedule name to its fields, not {type(raw).__name__}"]
    specs, problems = {}, []
    for name, values in raw.items():
        where = f"DBQUEUE['SCHEDULES'][{name!r}]"
        if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
            problems.append(f"{where} must be a dict such as {{'CRON': '0 * * * *', 'QUEUE': 'reports'}}")
            continue
        lower = {key.lower(): value for key, value in values.items()}
        spec, found = build_spec(name, lower, default_timezone=schedule_timezone(), origin="settings")
        for key, why in found:
            problems.append(f"{where} {why}" if key == "name" else f"{where}[{key.upper()!r}] {why}")
        if spec is not None:
            specs[name] = spec
    return specs, problems


def schedule_problems(raw: Any) -> list[str]:
    return schedule_specs(raw)[1]


def _queue_options(values: dict[str, Any]) -> QueueOptions:
    options = {key.lower(): values[key] for key in QUEUE_KEYS}
    options["rate_limit"] = parse_rate_limit(options["rate_limit"])
    options["kind_group_concurrency"] = dict(options["kind_group_concurrency"])
    return QueueOptions(**options)


@functools.cache
def get_settings() -> DbQueueSettings:
    """The validated settings; raises ImproperlyConfiguredQueue naming every problem."""
    raw = raw_setting()
    problems = find_problems(raw)
    if problems:
        raise ImproperlyConfiguredQueue("; ".join(problems))
    merged = {key: raw.get(key, default) for key, (default, _) in QUEUE_KEYS.items()}
    global_values = {key.lower(): raw.get(key, default) for key, (default, _) in GLOBAL_KEYS.items()}
    global_values["topics"] = {topic: list(queues) for topic, queues in global_values["topics"].items()}
    return DbQueueSettings(
        **global_values,
        defaults=_queue_options(merged),
        queues={name: _queue_options({**merged, **options}) for name, options in raw.get("QUEUES", {}).items()},
        schedules=schedule_specs(raw.get("SCHEDULES", {}))[0],
    )


def queue_options(queue: str) -> QueueOptions:
    return get_settings().for_queue(queue)


def database_for(queues: str | Iterable[str], using: str | None = None) -> str:
    """The one database that ``queues`` live on (``using`` overrides the DATABASE setting).

    Several queues must share one: a claim, a worker or a Tasks backend works
    in one database's transactions. Raises InvalidOption naming them otherwise.
    """
    if using:
        return using
    if isinstance(queues, str):  # one queue (every enqueue): its own database, nothing to compare
        return queue_options(queues).database
    names = list(queues)
    if not names:
        return get_settings().defaults.database
    placed = {name: queue_options(name).database for name in names}
    databases = set(placed.values())
    if len(databases) > 1:
        where = ", ".join(f"{name!r} on {alias!r}" for name, alias in sorted(placed.items()))
        raise InvalidOption(f"queues live on different databases ({where}); use them from each separately")
    return databases.pop()


def queues_by_database(queues: Iterable[str]) -> dict[str, list[str]]:
    """``queues`` grouped by the database each lives on (its DATABASE setting), in the order named."""
    groups: dict[str, list[str]] = {}
    for name in queues:
        groups.setdefault(queue_options(name).database, []).append(name)
    return groups


def describe_placement(groups: dict[str, list[str]]) -> str:
    """``default: a, b; other: c``: where grouped queues live, for an error message."""
    return "; ".join(f"{alias}: {', '.join(names)}" for alias, names in groups.items())


# --- TASKS backends ------------------------------------------------------------
#
# A ``TASKS`` backend served by django-dbqueue (django_dbqueue.tasks) gets its
# ``QUEUES`` and ``OPTIONS`` from the Tasks framework, which hands them to the
# backend; they are checked here so that every setting's rules live in one place.

# OPTIONS keys: (default, validator).
TASK_OPTION_KEYS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    # Runs of a task before it is FAILED; the attempts column holds up to 32767.
    "MAX_ATTEMPTS": (1, _integer(1, 32767)),
}

ENQUEUE_ON_COMMIT_ADVICE = (
    "ENQUEUE_ON_COMMIT is not an option of this backend: a task is written inside the caller's transaction "
    "on its queue's database, so it commits or rolls back with it; to enqueue only after a commit, call "
    "transaction.on_commit(functools.partial(my_task.enqueue, ...)) as Django's Tasks documentation shows"
)


@dataclass(frozen=True)
class TaskBackendOptions:
    """The validated ``OPTIONS`` of a TASKS backend served by django-dbqueue."""

    max_attempts: int


def task_backend_problems(params: Any) -> list[str]:
    """Return a sentence for each problem in one ``TASKS`` entry for our backend (empty if fine)."""
    from .validation import queue_name_problem

    if not isinstance(params, dict):
        return [f"must be a dict, not {type(params).__name__}"]
    problems = []
    if "ENQUEUE_ON_COMMIT" in params:
        problems.append(ENQUEUE_ON_COMMIT_ADVICE)
    queues = params.get("QUEUES", ["default"])
    names: list[str] = []
    if not isinstance(queues, list | tuple | set | frozenset) or not queues:
        problems.append(
            f"QUEUES must be a non-empty list of queue names (runqueueworker serves exactly these), not {queues!r}"
        )
    else:
        for name in queues:
            if (why := queue_name_problem(name)) is not None:
                problems.append(f"QUEUES has a bad queue name: {why}")
            else:
                names.append(name)
    options = params.get("OPTIONS", {})
    if not isinstance(options, dict):
        problems.append(f"OPTIONS must be a dict, not {type(options).__name__}")
        options = {}
    for key, value in options.items():
        spec = TASK_OPTION_KEYS.get(key)
        if key == "ENQUEUE_ON_COMMIT":
            problems.append(ENQUEUE_ON_COMMIT_ADVICE)
        elif spec is None:
            problems.append(unknown_key("OPTIONS", key, TASK_OPTION_KEYS))
        elif (why := spec[1](value)) is not None:
            problems.append(f"OPTIONS[{key!r}] {why}")
    if names and not find_problems(raw_setting()):
        databases = {name: get_settings().for_queue(name).database for name in names}
        if len(set(databases.values())) > 1:
            problems.append(
                f"QUEUES must all live on one database (result ids are message ids, unique per database); "
                f"DBQUEUE puts them on {databases}"
            )
    return problems


def task_backend_options(params: dict[str, Any]) -> TaskBackendOptions:
    """The OPTIONS with defaults filled in; call only once ``task_backend_problems`` found none."""
    options = params.get("OPTIONS", {})
    values = {key.lower(): options.get(key, default) for key, (default, _) in TASK_OPTION_KEYS.items()}
    return TaskBackendOptions(**values)


@receiver(setting_changed)
def _reset(setting: str, **kwargs: Any) -> None:
    if setting in ("DBQUEUE", "DATABASES", "TIME_ZONE"):
        get_settings.cache_clear()
