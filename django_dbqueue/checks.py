"""System checks: the DBQUEUE setting and what the queue's databases can do.

Ids are stable: E001 setting, E002 no SKIP LOCKED, W001 REPEATABLE READ,
E003 a schedule declared in code that is invalid (one in DBQUEUE["SCHEDULES"] is E001's);
W002 (a Tasks backend queue without ARCHIVE) is reported by DatabaseQueueBackend.check(),
W003 (a missing JDBC driver) by the analytics app, django_dbqueue.contrib.spark;
E004 METRICS on without prometheus_client, E005 TRACING on without OpenTelemetry;
W004 a setting whose name looks like DBQUEUE but is not it (DBQUEUES, DB_QUEUE...);
W005 a database behind a transaction pooler (POOLED_DATABASES) with options that break there.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register

from .conf import find_problems, get_settings, misspelled_setting_names, raw_setting
from .db import capabilities

# The pages a hint names, as a reader of an installed wheel (which has no docs/) can open them.
DOCS_URL = "https://github.com/django-dbqueue/django-dbqueue/blob/main/"


def page(path: str) -> str:
    """``docs/x.md`` as a hint names it: the page's address in the repository."""
    return f"{DOCS_URL}{path}"


SETTINGS_PAGE = page("docs/settings.md")


@register()
def check_setting(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    return [
        Error(
            problem,
            hint=f"See the settings reference, {SETTINGS_PAGE}, for every key and its default.",
            id="django_dbqueue.E001",
        )
        for problem in find_problems(raw_setting())
    ]


@register()
def check_setting_name(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """A setting named almost DBQUEUE is never read: every option in it would be silently off."""
    return [
        Warning(
            f"the setting {name} is not read by django-dbqueue, whose setting is named DBQUEUE",
            hint=f"Rename {name} to DBQUEUE (the settings reference: {SETTINGS_PAGE}), "
            "or silence django_dbqueue.W004 if it is yours.",
            id="django_dbqueue.W004",
        )
        for name in misspelled_setting_names()
    ]


# (setting, module, what it is, the distribution to pip install, the extra that installs it, page, check id)
EXTRAS = [
    (
        "METRICS",
        "prometheus_client",
        "prometheus_client",
        "prometheus_client",
        "metrics",
        "docs/metrics.md",
        "django_dbqueue.E004",
    ),
    (
        "TRACING",
        "opentelemetry",
        "the OpenTelemetry API",
        "opentelemetry-api",
        "otel",
        "docs/tracing.md",
        "django_dbqueue.E005",
    ),
]


@register()
def check_metrics(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """A setting that needs an extra whose package is missing: nothing would be counted or traced."""
    raw = raw_setting()
    return [
        Error(
            f"DBQUEUE[{key!r}] is True but {what} is not installed",
            hint=f"pip install {distribution} (the {extra} extra of django-dbqueue installs it; see {page(docs)})",
            id=check_id,
        )
        for key, package, what, distribution, extra, docs, check_id in EXTRAS
        if isinstance(raw, dict) and raw.get(key) is True and find_spec(package) is None
    ]


@register()
def check_pooled_databases(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """Options of a database behind PgBouncer in transaction pooling that fail there.

    A pooled connection is a different server session from one transaction to
    the next: psycopg's server-side prepared statements (made after five runs
    of a statement, with ``server_side_binding``) are then missing or someone
    else's, and Django's server-side cursors (``.iterator()``) outlive the
    transaction that opened them.
    """
    if find_problems(raw_setting()):
        return []
    warnings = []
    for alias in sorted(get_settings().pooled_databases):
        database = settings.DATABASES[alias]
        options = database.get("OPTIONS", {})
        problems = []
        if options.get("server_side_binding") and options.get("prepare_threshold", 5) is not None:
            problems.append("server_side_binding prepares statements: set OPTIONS['prepare_threshold'] = None")
        if not database.get("DISABLE_SERVER_SIDE_CURSORS"):
            problems.append("server-side cursors outlive a pooled transaction: set DISABLE_SERVER_SIDE_CURSORS = True")
        warnings += [
            Warning(
                f"database {alias!r} is behind a transaction pooler (DBQUEUE['POOLED_DATABASES']): {problem}",
                hint=f"See {page('docs/high-availability.md')}, PgBouncer in transaction pooling.",
                id="django_dbqueue.W005",
            )
            for problem in problems
        ]
    return warnings


@register()
def check_schedules(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Schedules declared with ``@schedule``: each problem names the schedule and the field."""
    from .schedules.registry import declared

    return [
        Error(problem, hint=f"See {page('docs/schedules.md')} for every field.", id="django_dbqueue.E003")
        for problem in declared()[1]
    ]


def _queue_databases() -> set[str]:
    if find_problems(raw_setting()):
        return set()
    dbq = get_settings()
    return {dbq.defaults.database} | {options.database for options in dbq.queues.values()}


@register(Tags.database)
def check_databases(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Error | Warning]:
    """Run only with ``--database`` (Django does not touch databases otherwise)."""
    messages: list[Error | Warning] = []
    for alias in sorted(_queue_databases() & set(databases or ())):
        if capabilities.lacks_skip_locked(alias):
            messages.append(
                Error(
                    f"database {alias!r} cannot SELECT ... FOR UPDATE SKIP LOCKED; "
                    "django-dbqueue needs MySQL >= 8.0.1, MariaDB >= 10.6 or PostgreSQL",
                    hint=f"See {page('docs/databases.md')}.",
                    id="django_dbqueue.E002",
                )
            )
        if capabilities.runs_repeatable_read(alias):
            messages.append(
                Warning(
                    f"database {alias!r} runs at REPEATABLE READ; queue operations want READ COMMITTED "
                    "(a claim inside a longer transaction would not see newer messages, "
                    "and gap locks make deadlocks more likely)",
                    hint="Set DATABASES[...]['OPTIONS']['isolation_level'] = 'read committed' (Django's default). "
                    f"See {page('docs/databases.md')}.",
                    id="django_dbqueue.W001",
                )
            )
    return messages
