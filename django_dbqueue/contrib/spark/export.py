"""``exportarchive``: the archive (and the live backlog) as Parquet, for analysts kept away from production.

Streams the tables in ``id`` order, ``chunk_size`` rows per query and per
Parquet row group, so memory stays flat however large the archive. Payloads,
headers and results are left out: they are the application's data, which
analysts of the queue do not need and often must not see.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from ...models import ArchivedMessage, Message
from ...progress import NullProgress, Progress
from .session import require

ARCHIVE_COLUMNS = {
    "id": "int64",
    "message_id": "int64",
    "queue": "string",
    "kind": "string",
    "priority": "int32",
    "outcome": "string",
    "attempts": "int32",
    "max_attempts": "int32",
    "created_at": "timestamp",
    "first_available_at": "timestamp",
    "claimed_at": "timestamp",
    "finished_at": "timestamp",
    "expires_at": "timestamp",
    "finished_by": "string",
    "last_error": "string",
    "replay_of": "int64",
}
LIVE_COLUMNS = {
    "id": "int64",
    "queue": "string",
    "kind": "string",
    "priority": "int32",
    "attempts": "int32",
    "created_at": "timestamp",
    "first_available_at": "timestamp",
    "available_at": "timestamp",
}
DEFAULT_CHUNK_SIZE = 50_000


@dataclass(frozen=True)
class ExportResult:
    archive_rows: int
    live_rows: int
    archive_path: str
    live_path: str


def _schema(columns: dict[str, str]) -> Any:
    pa = require("pyarrow")
    types = {"int64": pa.int64(), "int32": pa.int32(), "string": pa.string(), "timestamp": pa.timestamp("us", "UTC")}
    return pa.schema([(name, types[kind]) for name, kind in columns.items()])


def _chunks(queryset: QuerySet[Any], columns: list[str], chunk_size: int) -> Iterator[list[tuple[Any, ...]]]:
    last = None
    while True:
        page = queryset if last is None else queryset.filter(id__gt=last)
        rows = list(page.order_by("id").values_list(*columns)[:chunk_size])
        if not rows:
            return
        yield rows
        last = rows[-1][0]


def _write(path: str, queryset: QuerySet[Any], columns: dict[str, str], chunk_size: int, progress: Progress) -> int:
    """Write ``queryset`` to ``path`` atomically (a temporary file renamed at the end)."""
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    schema = _schema(columns)
    names = list(columns)
    written = 0
    partial = f"{path}.partial"
    # The total costs a COUNT: only when someone watches.
    progress.start(f"writing {os.path.basename(path)}", total=queryset.count() if progress.active else None)
    with pq.ParquetWriter(partial, schema) as writer:
        for rows in _chunks(queryset, names, chunk_size):
            arrays = [pa.array(values, type=schema.field(i).type) for i, values in enumerate(zip(*rows, strict=True))]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            written += len(rows)
            progress.advance(len(rows))
    progress.finish()
    os.replace(partial, path)
    return written


def export_archive(
    directory: str | os.PathLike[str],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    using: str = "default",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Progress | None = None,
) -> ExportResult:
    """Write ``archive.parquet`` and ``live.parquet`` into ``directory`` (replacing them).

    With ``since``/``until``: archived messages that finished or were created in
    ``[since, until)``, and live ones created in it, as ``queueanalytics`` reads them.
    ``progress`` hears the rows written, chunk by chunk.
    """
    directory = os.fspath(directory)
    progress = progress or NullProgress()
    os.makedirs(directory, exist_ok=True)
    archive = ArchivedMessage.objects.using(using).all()
    live = Message.objects.using(using).all()
    if since is not None or until is not None:
        created, finished = Q(), Q()
        if since is not None:
            created &= Q(created_at__gte=since)
            finished &= Q(finished_at__gte=since)
        if until is not None:
            created &= Q(created_at__lt=until)
            finished &= Q(finished_at__lt=until)
        archive = archive.filter(created | finished)
        live = live.filter(created)
    paths = (os.path.join(directory, "archive.parquet"), os.path.join(directory, "live.parquet"))
    return ExportResult(
        archive_rows=_write(paths[0], archive, ARCHIVE_COLUMNS, chunk_size, progress),
        live_rows=_write(paths[1], live, LIVE_COLUMNS, chunk_size, progress),
        archive_path=paths[0],
        live_path=paths[1],
    )


# The data lake: exportarchive --incremental.
PARTITION = "finished_date"
DEFAULT_SETTLE = timedelta(minutes=5)


@dataclass(frozen=True)
class LakeExport:
    rows: int
    files: list[str]  # paths written, relative to the directory
    watermark: tuple[datetime, int] | None  # the last row exported, by (finished_at, id)


def watermark_name(directory: str | os.PathLike[str]) -> str:
    """The watermark's name: one per output directory (hashed when the path is long)."""
    path = os.path.abspath(os.fspath(directory))
    name = f"exportarchive:{path}"
    return name if len(name) <= 255 else f"exportarchive:sha256:{hashlib.sha256(path.encode()).hexdigest()}"


def _has_partitions(directory: str) -> bool:
    return os.path.isdir(directory) and any(entry.startswith(f"{PARTITION}=") for entry in os.listdir(directory))


def export_incremental(
    directory: str | os.PathLike[str],
    *,
    using: str = "default",
    settle: timedelta = DEFAULT_SETTLE,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LakeExport:
    """Append the archive rows new since the last run to ``directory``, one Parquet file per day touched.

    Rows are taken in ``(finished_at, id)`` order after the watermark and only
    up to ``settle`` before now: a row committed late carries an older
    ``finished_at``, and it must not land behind the watermark. The files are
    named after the watermark the run started from
    (``finished_date=YYYY-MM-DD/part-<finished_at>-<id>.parquet``) and renamed
    into place only when all are written; the watermark moves after that. A
    run that crashed before moving it is redone by the next one under the same
    names, replacing its files: no row is ever written twice.
    """
    from .incremental import Mark, read_watermark, save_watermark

    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    directory = os.path.abspath(os.fspath(directory))
    if settle < timedelta(0):
        raise ValueError("settle must not be negative")
    run_at = timezone.now()
    name = watermark_name(directory)
    previous = read_watermark(name, using)
    if previous is not None and not _has_partitions(directory):
        previous = None  # the directory was emptied or moved: export everything again
    os.makedirs(directory, exist_ok=True)
    rows = ArchivedMessage.objects.using(using).filter(finished_at__lt=run_at - settle)
    if previous is not None:
        after = previous.finished_at
        rows = rows.filter(Q(finished_at__gt=after) | Q(finished_at=after, id__gt=previous.last_id))
        tag = f"{after.astimezone(UTC):%Y%m%dT%H%M%S%fZ}-{previous.last_id}"
    else:
        tag = "start"
    schema = _schema(ARCHIVE_COLUMNS)
    names = list(ARCHIVE_COLUMNS)
    at = names.index("finished_at")
    written, files, last = 0, [], None
    day: date | None = None
    writer: Any = None
    partials: list[tuple[str, str]] = []

    def close() -> None:
        if writer is not None:
            writer.close()

    try:
        for chunk in _keyset_chunks(rows, names, chunk_size):
            start = 0
            while start < len(chunk):
                current = chunk[start][at].astimezone(UTC).date()
                end = start
                while end < len(chunk) and chunk[end][at].astimezone(UTC).date() == current:
                    end += 1
                if current != day:
                    close()
                    day = current
                    relative = os.path.join(f"{PARTITION}={day.isoformat()}", f"part-{tag}.parquet")
                    final = os.path.join(directory, relative)
                    partial = os.path.join(os.path.dirname(final), f".part-{tag}.parquet.partial")
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    writer = pq.ParquetWriter(partial, schema)
                    partials.append((partial, final))
                    files.append(relative)
                part = chunk[start:end]
                arrays = [
                    pa.array(values, type=schema.field(i).type) for i, values in enumerate(zip(*part, strict=True))
                ]
                writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
                written += len(part)
                start = end
            last = (chunk[-1][at], chunk[-1][0])
    finally:
        close()
    for partial, final in partials:
        os.replace(partial, final)
    if last is not None:
        save_watermark(name, using, Mark(last[0], last[1]), run_at, written)
    return LakeExport(rows=written, files=files, watermark=last)


def _keyset_chunks(queryset: QuerySet[Any], columns: list[str], chunk_size: int) -> Iterator[list[tuple[Any, ...]]]:
    """``queryset`` in ``(finished_at, id)`` order, ``chunk_size`` rows per query (the archive's index)."""
    at = columns.index("finished_at")
    last: tuple[datetime, int] | None = None
    while True:
        page = queryset
        if last is not None:
            page = page.filter(Q(finished_at__gt=last[0]) | Q(finished_at=last[0], id__gt=last[1]))
        rows = list(page.order_by("finished_at", "id").values_list(*columns)[:chunk_size])
        if not rows:
            return
        yield rows
        last = (rows[-1][at], rows[-1][0])
