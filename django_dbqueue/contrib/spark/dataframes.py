"""``enqueue_dataframe``: bulk enqueue from a Spark DataFrame, idempotent by key.

Each partition runs in a Spark executor's Python worker, which is not the
Django process that called us and, on a cluster, not even on its host. So
the driver ships the one thing the workers need, its resolved ``DATABASES``
entry for the queue's database, and each worker configures a minimal Django
(only django-dbqueue installed; the project's code and settings module are
not needed on the executors) and inserts through the same path as
``enqueue_many``: multi-row inserts in chunks, insert-if-absent on keys.
Running the same DataFrame again inserts nothing while its messages are
still live; keys deduplicate live messages only (see docs/api.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connections

from ... import validation
from ...conf import get_settings, queue_options
from ...exceptions import InvalidOption
from ...progress import NullProgress, Progress
from .progress import watch_counters

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class EnqueueResult:
    inserted: int  # new messages
    existing: int  # rows whose key was live already: nothing inserted


def enqueue_dataframe(
    df: DataFrame,
    queue: str,
    *,
    key_col: str,
    payload_cols: Sequence[str] | None = None,
    kind: str = "",
    using: str | None = None,
    batch_size: int | None = None,
    progress: Progress | None = None,
) -> EnqueueResult:
    """Enqueue one message per row of ``df`` into ``queue``; returns how many were new.

    ``key_col``: the column holding each message's deduplication key (its
    text; no NULLs). ``payload_cols``: the columns that make the payload, a
    JSON object keyed by column name (default: every other column). Values
    must be JSON types (strings, numbers, booleans, lists, maps); cast dates
    and decimals first. ``batch_size`` rows per INSERT (default
    ``ENQUEUE_BATCH_SIZE``). ``progress`` (e.g.
    ``django_dbqueue.progress.progress_to(sys.stderr)``) shows the partitions
    done and the rows they sent, as each partition finishes.
    """
    validation.validate_queue_name(queue)
    validation.validate_kind(kind)
    columns = list(df.columns)
    if key_col not in columns:
        raise InvalidOption(f"key_col {key_col!r} is not a column of the DataFrame; its columns: {columns}")
    payload_cols = [c for c in columns if c != key_col] if payload_cols is None else list(payload_cols)
    if isinstance(payload_cols, str) or not payload_cols:
        raise InvalidOption("payload_cols must name at least one column")
    unknown = [c for c in payload_cols if c not in columns]
    if unknown:
        raise InvalidOption(f"payload_cols {unknown} are not columns of the DataFrame; its columns: {columns}")
    batch_size = get_settings().enqueue_batch_size if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidOption(f"batch_size must be a positive integer, not {batch_size!r}")
    database = _shippable(connections[using or queue_options(queue).database].settings_dict)
    work = functools.partial(
        _enqueue_partition,
        queue=queue,
        key_col=key_col,
        payload_cols=payload_cols,
        kind=kind,
        database=database,
        batch_size=batch_size,
    )
    rdd = df.select(key_col, *payload_cols).rdd
    with watch_counters(rdd.context, progress or NullProgress(), f"enqueue to {queue}", rdd.getNumPartitions()) as done:
        counts = rdd.mapPartitions(functools.partial(work, done=done)).collect()
    return EnqueueResult(inserted=sum(c[0] for c in counts), existing=sum(c[1] for c in counts))


def _shippable(settings_dict: dict[str, Any]) -> dict[str, Any]:
    keys = ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS", "TIME_ZONE")
    return {key: settings_dict[key] for key in keys if key in settings_dict}


def executor_alias(database: dict[str, Any]) -> str:
    """Configure (once per worker process) a minimal Django with ``database``; returns its alias.

    Workers are reused between tasks, and tasks of other calls may target
    other databases: each database gets its own alias, named by its settings.
    """
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(INSTALLED_APPS=["django_dbqueue"], DATABASES={}, USE_TZ=True, TIME_ZONE="UTC")
        django.setup()
    alias = "dbqueue_" + hashlib.sha256(json.dumps(database, sort_keys=True).encode()).hexdigest()[:16]
    if alias not in connections.settings:
        connections.settings[alias] = connections.configure_settings({"default": dict(database)})["default"]
    return alias


def _enqueue_partition(
    rows: Iterable[Any],
    *,
    queue: str,
    key_col: str,
    payload_cols: list[str],
    kind: str,
    database: dict[str, Any],
    batch_size: int,
    done: tuple[Any, Any] | None = None,
) -> Iterator[tuple[int, int]]:
    """Runs on an executor: insert this partition's rows in chunks; yields (inserted, existing)."""
    alias = executor_alias(database)
    from ...operations import build_message, enqueue_built

    inserted = existing = 0

    def flush(pending: list[Any]) -> None:
        nonlocal inserted, existing
        for message in enqueue_built(pending, alias):
            if message.was_created:
                inserted += 1
            else:
                existing += 1

    pending: list[Any] = []
    try:
        for row in rows:
            key = row[key_col]
            if key is None:
                raise InvalidOption(f"key_col {key_col!r} is NULL in a row; every message needs a key")
            payload = {col: row[col] for col in payload_cols}
            pending.append(build_message(queue, payload, {"kind": kind, "key": str(key)}))
            if len(pending) >= batch_size:
                flush(pending)
                pending = []
        if pending:
            flush(pending)
    finally:
        connections[alias].close()
    if done is not None:  # the driver's progress: one more partition, and its rows
        done[0].add(1)
        done[1].add(inserted + existing)
    yield inserted, existing
