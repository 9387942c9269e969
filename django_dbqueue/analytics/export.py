"""``exportarchive``: the archive (and the live backlog) as Parquet, for analysts kept away from production.

Streams the tables in ``id`` order, ``chunk_size`` rows per query and per
Parquet row group, so memory stays flat however large the archive. Payloads,
headers and results are left out: they are the application's data, which
analysts of the queue do not need and often must not see.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q

from ..models import ArchivedMessage, Message
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


def _schema(columns: dict[str, str]):
    pa = require("pyarrow")
    types = {"int64": pa.int64(), "int32": pa.int32(), "string": pa.string(), "timestamp": pa.timestamp("us", "UTC")}
    return pa.schema([(name, types[kind]) for name, kind in columns.items()])


def _chunks(queryset, columns: list[str], chunk_size: int) -> Iterator[list[tuple]]:
    last = None
    while True:
        page = queryset if last is None else queryset.filter(id__gt=last)
        rows = list(page.order_by("id").values_list(*columns)[:chunk_size])
        if not rows:
            return
        yield rows
        last = rows[-1][0]


def _write(path: str, queryset, columns: dict[str, str], chunk_size: int) -> int:
    """Write ``queryset`` to ``path`` atomically (a temporary file renamed at the end)."""
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    schema = _schema(columns)
    names = list(columns)
    written = 0
    partial = f"{path}.partial"
    with pq.ParquetWriter(partial, schema) as writer:
        for rows in _chunks(queryset, names, chunk_size):
            arrays = [pa.array(values, type=schema.field(i).type) for i, values in enumerate(zip(*rows, strict=True))]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            written += len(rows)
    os.replace(partial, path)
    return written


def export_archive(
    directory: str | os.PathLike,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    using: str = "default",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> ExportResult:
    """Write ``archive.parquet`` and ``live.parquet`` into ``directory`` (replacing them).

    With ``since``/``until``: archived messages that finished or were created in
    ``[since, until)``, and live ones created in it, as ``queueanalytics`` reads them.
    """
    directory = os.fspath(directory)
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
        archive_rows=_write(paths[0], archive, ARCHIVE_COLUMNS, chunk_size),
        live_rows=_write(paths[1], live, LIVE_COLUMNS, chunk_size),
        archive_path=paths[0],
        live_path=paths[1],
    )
