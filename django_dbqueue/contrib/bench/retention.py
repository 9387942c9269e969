"""queuebench's ``archive`` phase: retention by dropping partitions against deleting rows.

The archive is filled with ``--history-rows`` rows spread evenly over
``--history-days`` days (one day per partition), then half the days are
removed as the reaper would: by its batched ``DELETE`` on the plain
archive, by retiring partitions on the partitioned one (taken out of the
archive; their tables are freed afterwards, timed apart, as the reaper's
later passes free them). Each layout is
measured the same way: the retention pass's time and the rows it deleted;
the live queue's drain rate while the pass runs against the rate just
before it; what the server is left to clean up (InnoDB's history list,
PostgreSQL's dead tuples) and the archive's size on disk. The phase
converts the archive's layout, so it refuses an archive that holds rows
other than the benchmark's own, and leaves the archive plain and empty of
them at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Q

from ...db import partitions as ddl
from ...db.clock import db_now
from ...models import ArchivedMessage
from ...models.partitions import ArchiveLayout, period_start
from ...models.statements import ARCHIVE_TABLE
from ...operations import ack_many, claim
from .rawsql import archive_bytes, archive_garbage, truncate

HISTORY_QUEUE = "queuebench-history"
SEED_QUEUE = "queuebench-history-seed"
SEED = 1000
# The retention pass starts once the drain acks, or after this many seconds.
START_WITHIN = 60.0
# The columns an archive row needs, copied as they are; queue and finished_at are set by each copy.
COPIED = (
    "message_id, kind, payload, headers, priority, created_at, first_available_at, claimed_at, "
    "attempts, outcome, finished_by, last_error, replayed_by"
)


class RetentionBench:
    """One layout's measurement.

    ``drain()`` is the benchmark's drain of the live queue (messages/s);
    ``draining(since)`` tells whether its workers have acked since
    ``since``, so that the retention pass meets the acks, not the drain's
    own clean-up and fill before them.
    """

    def __init__(
        self,
        using: str,
        rows: int,
        days: int,
        batch_size: int,
        drain: Callable[[], float],
        fill: Callable[..., None],
        draining: Callable[[datetime], bool],
    ) -> None:
        self.using, self.rows, self.days, self.batch_size = using, rows, days, batch_size
        self.drain, self.fill, self.draining = drain, fill, draining
        self.layout = ArchiveLayout(using)

    def check_archive(self) -> None:
        others = ArchivedMessage.objects.using(self.using).exclude(queue__startswith="queuebench")
        if others.exists():
            raise RuntimeError(
                "the archive phase converts the archive's layout and empties it of the benchmark's rows: "
                "run it on a database whose archive holds no other rows"
            )

    def set_layout(self, partitioned: bool) -> None:
        truncate(self.using, ARCHIVE_TABLE)
        if self.layout.partitioned() != partitioned:
            # A partition for each day of the history about to be loaded.
            since = db_now(self.using) - timedelta(days=self.days)
            self.layout.convert("daily" if partitioned else None, since=since)

    def fill_history(self) -> None:
        """``rows`` rows over ``days`` days: real acks for a seed, then each day's rows doubled by INSERT ... SELECT."""
        self.fill(SEED_QUEUE, SEED)
        ack_many(claim(SEED_QUEUE, SEED, worker="queuebench"))
        now = db_now(self.using)
        per_day = max(1, self.rows // self.days)
        qn = connections[self.using].ops.quote_name
        table = qn(ARCHIVE_TABLE)
        insert = f"INSERT INTO {table} ({COPIED}, queue, finished_at) SELECT {COPIED}, %s, %s FROM {table}"
        adapt = connections[self.using].ops.adapt_datetimefield_value
        with connections[self.using].cursor() as cursor:
            for day in range(self.days):
                when = adapt(now - timedelta(days=day, minutes=1))
                have = 0
                while have < per_day:
                    take = min(SEED if have == 0 else have, per_day - have)
                    source = (
                        ("queue = %s", [SEED_QUEUE])
                        if have == 0
                        else ("queue = %s AND finished_at = %s", [HISTORY_QUEUE, when])
                    )
                    cursor.execute(f"{insert} WHERE {source[0]} LIMIT {int(take)}", [HISTORY_QUEUE, when, *source[1]])
                    have += take
            cursor.execute(f"DELETE FROM {qn(ARCHIVE_TABLE)} WHERE queue = %s", [SEED_QUEUE])

    def measure(self, partitioned: bool) -> dict[str, Any]:
        self.set_layout(partitioned)
        self.fill_history()
        archive = ArchivedMessage.objects.using(self.using).filter(queue=HISTORY_QUEUE)
        before_rows = archive.count()
        size_before = archive_bytes(self.using, ARCHIVE_TABLE)
        garbage_before = archive_garbage(self.using, ARCHIVE_TABLE)
        quiet = self.drain()
        # At a day's start, so that both layouts remove the same whole days (the reaper's own cut-off is
        # now minus RETENTION_DAYS: the day it falls in is then pruned by rows on either layout).
        cutoff = period_start(db_now(self.using) - timedelta(days=self.days // 2), "daily", self.layout.zone)
        outcome: dict[str, Any] = {}

        since = db_now(self.using)

        def retain() -> None:
            deadline = time.monotonic() + START_WITHIN
            while not (acked := self.draining(since)) and time.monotonic() < deadline:
                time.sleep(0.01)
            outcome["amid_acks"] = acked  # False: the drain's ratio below says nothing of the pass
            started = time.perf_counter()
            try:
                dropped = self.layout.retire_before(cutoff) if partitioned else []
                deleted = ArchivedMessage.objects.using(self.using).prune(
                    Q(queue=HISTORY_QUEUE), cutoff, self.batch_size
                )
                outcome.update(seconds=time.perf_counter() - started, deleted=deleted, dropped=len(dropped))
            except Exception as exc:  # reported by the phase, not lost with the thread
                outcome["error"] = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=retain, name="queuebench-retention")
        thread.start()
        during = self.drain()
        thread.join()
        if "error" in outcome:
            raise RuntimeError(f"the retention pass failed: {outcome['error']}") from outcome["error"]
        # The retired partitions' tables, freed as the reaper's next passes would (here all at once, timed).
        started = time.perf_counter()
        freed = ddl.drop_detached(self.using, ARCHIVE_TABLE)
        free_seconds = time.perf_counter() - started
        garbage_after = archive_garbage(self.using, ARCHIVE_TABLE)
        after_rows = archive.count()
        return {
            "rows": before_rows,
            "rows_removed": before_rows - after_rows,
            "rows_deleted": outcome["deleted"],
            "partitions_dropped": outcome["dropped"],
            "retention_seconds": outcome["seconds"],
            "amid_acks": outcome["amid_acks"],
            "tables_freed": len(freed),
            "free_seconds": free_seconds,
            "drain_quiet": quiet,
            "drain_during": during,
            "bytes_before": size_before,
            "bytes_after": archive_bytes(self.using, ARCHIVE_TABLE),
            **{f"{key}_before": value for key, value in garbage_before.items()},
            **{f"{key}_after": value for key, value in garbage_after.items()},
        }

    def run(self) -> dict[str, dict[str, Any]]:
        """Both layouts, DELETE first; the archive plain and without the benchmark's rows afterwards."""
        self.check_archive()
        was_partitioned = self.layout.partitioned()
        try:
            return {"delete": self.measure(False), "drop": self.measure(True)}
        finally:
            self.set_layout(was_partitioned)
