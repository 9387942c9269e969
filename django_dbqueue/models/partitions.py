"""The archive's layout: partitioned by finish time (``ARCHIVE_PARTITIONS``) or plain.

Partitions are days or ISO weeks (from Monday) in Django's ``TIME_ZONE``,
stored as UTC bounds; each is named by the local date it starts
(``p20261126``). `ArchiveLayout` keeps `AHEAD` partitions created ahead of
now, drops partitions that lie wholly before a cut-off (retention without a
row deleted), and converts an archive between the two layouts while the
queue runs: the other layout is built empty beside it, the names are
swapped in one step (new rows go to it at once), and the old rows are
copied behind in id order, a bounded chunk a statement. Each chunk is one
atomic ``INSERT ... SELECT``, and where to go on is read from the tables
themselves (the highest old id already copied), so a conversion killed at
any point resumes with nothing lost or doubled. The vendor DDL is in
``db.partitions``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

from ..conf import django_time_zone
from ..db import partitions as ddl
from ..db import transactions
from ..db.clock import db_now
from ..db.partitions import Partition, Range
from ..exceptions import InvalidOption
from .statements import ARCHIVE_TABLE

GRANULARITIES = ("daily", "weekly")
# Partitions kept created ahead of now: a week of days, four weeks.
AHEAD = {"daily": 7, "weekly": 4}
PARTITION_COLUMN = "finished_at"
# The table the rows being copied behind stay in until the copy is done, and the staging names.
OLD_TABLE = f"{ARCHIVE_TABLE}_old"
STAGING = {True: f"{ARCHIVE_TABLE}_partitioned", False: f"{ARCHIVE_TABLE}_plain"}
LOCK = "django_dbqueue.archive_layout"
DEFAULT_CHUNK = 10_000


def period_start(moment: datetime, granularity: str, zone: ZoneInfo) -> datetime:
    """The start (UTC) of the day or ISO week, in ``zone``, that ``moment`` falls in."""
    local = moment.astimezone(zone).date()
    if granularity == "weekly":
        local -= timedelta(days=local.weekday())
    return _midnight(local, zone)


def _midnight(day: date, zone: ZoneInfo) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(UTC)


def ranges(granularity: str, zone: ZoneInfo, start: datetime, end: datetime) -> list[Range]:
    """The partitions covering ``start`` to ``end`` (each labelled by the local date it starts)."""
    step = 7 if granularity == "weekly" else 1
    first = period_start(start, granularity, zone).astimezone(zone).date()
    found = []
    day = first
    while True:
        upper_day = day + timedelta(days=step)
        found.append(Range(day.strftime("%Y%m%d"), _midnight(upper_day, zone)))
        if found[-1].upper > end:
            return found
        day = upper_day


def check_granularity(granularity: str | None) -> None:
    if granularity is not None and granularity not in GRANULARITIES:
        raise InvalidOption(f"ARCHIVE_PARTITIONS must be 'daily', 'weekly' or None, not {granularity!r}")


@dataclass
class Upkeep:
    """What one upkeep did: the labels of the partitions created, the partitions dropped."""

    created: list[str] = field(default_factory=list)
    dropped: list[Partition] = field(default_factory=list)
    plain: bool = False
    # The steps that gave up waiting for the archive's lock (a long transaction on it), and why.
    waited: list[str] = field(default_factory=list)
    # The tables of partitions retired by this pass or an earlier one, dropped now (their files freed).
    swept: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What a conversion will do (``--dry-run`` prints it)."""

    using: str
    target: str | None
    partitioned_now: bool
    resuming: bool
    rows_to_copy: int
    ranges: list[Range] = field(default_factory=list)

    @property
    def nothing_to_do(self) -> bool:
        return not self.resuming and self.partitioned_now == (self.target is not None)

    def __str__(self) -> str:
        layout = f"partitioned {self.target}" if self.target else "plain (one table)"
        lines = [f"database {self.using!r}: the archive is {'partitioned' if self.partitioned_now else 'plain'}"]
        if self.nothing_to_do:
            return f"{lines[0]} already; nothing to convert"
        if self.resuming:
            lines.append(f"a conversion is under way: {self.rows_to_copy:,} old row(s) left to copy behind")
        else:
            lines.append(f"1. create {STAGING[self.target is not None]} empty, {layout}")
            if self.ranges:
                lines.append(
                    f"   {len(self.ranges)} partition(s) from {self.ranges[0].label} to {self.ranges[-1].label} "
                    f"(ends {self.ranges[-1].upper:%Y-%m-%d %H:%M} UTC), and a catch-all for later rows"
                )
            lines.append(f"2. swap the names: new rows go to it at once, the old table becomes {OLD_TABLE}")
            lines.append(f"3. copy the {self.rows_to_copy:,} old row(s) behind, ids kept, in chunks")
        lines.append(f"{'4' if not self.resuming else '-'}. drop {OLD_TABLE} once every row is copied")
        return "\n".join(lines)


class ArchiveLayout:
    """The archive's partitions on database ``using``; converting it between layouts; its upkeep by the reaper."""

    def __init__(self, using: str = "default", zone: str | None = None) -> None:
        self.using = using
        self.zone = ZoneInfo(zone or django_time_zone())

    # --- what is there -----------------------------------------------------------

    def partitioned(self) -> bool:
        return ddl.is_partitioned(self.using, ARCHIVE_TABLE)

    def partitions(self) -> list[Partition]:
        return ddl.partitions(self.using, ARCHIVE_TABLE) if ddl.supported(self.using) else []

    def converting(self) -> bool:
        """Whether a conversion's old rows are still being copied behind."""
        return ddl.supported(self.using) and ddl.exists(self.using, OLD_TABLE)

    # --- converting ----------------------------------------------------------------

    def plan(self, granularity: str | None) -> Plan:
        check_granularity(granularity)
        ddl.require(self.using)
        resuming = self.converting()
        source = OLD_TABLE if resuming else ARCHIVE_TABLE
        after = self._copied_up_to(ddl.id_bounds(self.using, OLD_TABLE)[1]) if resuming else 0
        left = ddl.count_after(self.using, source, after)
        plan = Plan(self.using, granularity, self.partitioned(), resuming, left)
        if not resuming and granularity is not None:
            plan.ranges = self._ranges_for(granularity, ARCHIVE_TABLE)
        return plan

    def _ranges_for(self, granularity: str, source: str, since: datetime | None = None) -> list[Range]:
        """From the oldest row's period (or ``since``'s, if older) to `AHEAD` periods past now."""
        now = db_now(self.using)
        oldest = ddl.oldest(self.using, source, PARTITION_COLUMN) or now
        return ranges(granularity, self.zone, min(oldest, now, since or now), horizon(granularity, now))

    def convert(
        self,
        granularity: str | None,
        chunk_size: int = DEFAULT_CHUNK,
        on_chunk: Callable[[int], object] | None = None,
        *,
        since: datetime | None = None,
    ) -> int:
        """Convert the archive to ``granularity`` (None: plain) or resume the conversion under way; rows copied.

        The partitions start at the oldest row's period, or at ``since``'s
        when that is older (history about to be loaded).
        Refuses a second conversion at once (a database lock), a conversion
        to the layout the archive has, and SQLite.
        """
        check_granularity(granularity)
        ddl.require(self.using)
        with self._locked() as held:
            if not held:
                raise InvalidOption("another process is converting the archive (or keeping its partitions) right now")
            if not self.converting():
                if self.partitioned() == (granularity is not None):
                    now = "partitioned" if granularity else "plain"
                    raise InvalidOption(f"the archive on {self.using!r} is {now} already; nothing to convert")
                self._start(granularity, since)
            return self._copy_behind(chunk_size, on_chunk)

    def _start(self, granularity: str | None, since: datetime | None = None) -> None:
        # Partitions retired and not freed yet: past retention, and on PostgreSQL in the way of the new names.
        ddl.drop_detached(self.using, ARCHIVE_TABLE)
        staging = STAGING[granularity is not None]
        if ddl.exists(self.using, staging):  # a conversion killed before its swap: nothing was written to it
            ddl.drop_table(self.using, staging)
        planned = self._ranges_for(granularity, ARCHIVE_TABLE, since) if granularity else None
        ddl.create_like(
            self.using, ARCHIVE_TABLE, staging, column=PARTITION_COLUMN, ranges=planned, prefix=ARCHIVE_TABLE
        )
        ddl.swap(self.using, ARCHIVE_TABLE, staging, OLD_TABLE)

    def _copied_up_to(self, old_high: int) -> int:
        """The highest old id already in the new table: the old rows are copied in id order, a chunk atomically."""
        return ddl.id_bounds(self.using, ARCHIVE_TABLE, below=old_high)[1]

    def _copy_behind(self, chunk_size: int, on_chunk: Callable[[int], object] | None) -> int:
        names = ddl.columns(self.using, OLD_TABLE)
        high = ddl.id_bounds(self.using, OLD_TABLE)[1]
        after = self._copied_up_to(high)
        total = 0
        while (end := ddl.chunk_end(self.using, OLD_TABLE, after, chunk_size)) is not None:
            copied = ddl.copy_ids(self.using, OLD_TABLE, ARCHIVE_TABLE, names, after, end)
            after = end
            total += copied
            if on_chunk is not None:
                on_chunk(copied)
        ddl.drop_old(self.using, ARCHIVE_TABLE, OLD_TABLE)
        return total

    def _locked(self) -> AbstractContextManager[bool]:
        """The lock that one conversion or one upkeep holds at a time."""
        return transactions.try_lock(self.using, transactions.lock_name(self.using, LOCK))

    # --- upkeep --------------------------------------------------------------------

    def upkeep(self, granularity: str, before: datetime | None) -> Upkeep:
        """The reaper's step: partitions created ahead, those wholly before ``before`` retired (None: none), one freed.

        Skipped while a conversion runs or another process keeps the
        partitions, and on a plain archive (`Upkeep.plain`: the setting asks
        for partitions the table does not have yet). Each step waits at most
        `ddl.UPKEEP_LOCK_WAIT_SECONDS` for the archive's lock and is skipped
        (`Upkeep.waited`) when a long transaction holds it, so that acks do
        not queue behind it for long; the reaper tries again later.
        """
        if not ddl.supported(self.using):
            return Upkeep()  # SQLite: one table, always (docs/archive.md)
        with self._locked() as held:
            if not held or self.converting():
                return Upkeep()
            if not self.partitioned():
                return Upkeep(plain=True)
            done = Upkeep()
            wait = ddl.UPKEEP_LOCK_WAIT_SECONDS
            try:
                done.created = self.ensure_ahead(granularity, lock_wait=wait)
            except ddl.LockNotFree as exc:
                done.waited.append(f"creating partitions ahead: {exc}")
            if before is not None:
                due = self.droppable(before)
                try:
                    done.dropped = self._take_out(due, ddl.detach_partitions, wait)
                except ddl.LockNotFree as exc:
                    # MariaDB retires a partition a statement: those before the one that waited are out.
                    left = {p.name for p in self.partitions()}
                    done.dropped = [p for p in due if p.name not in left]
                    done.waited.append(f"retiring partitions: {exc}")
            try:  # takes no lock of the archive's: goes on whatever the steps above met
                done.swept = ddl.drop_detached(self.using, ARCHIVE_TABLE, limit=FREED_PER_PASS, lock_wait=wait)
            except ddl.LockNotFree as exc:
                done.waited.append(f"freeing retired partitions: {exc}")
            return done

    def ensure_ahead(self, granularity: str, now: datetime | None = None, lock_wait: float | None = None) -> list[str]:
        """Create the partitions missing from the last one to `AHEAD` periods past ``now``; their labels.

        After an outage the missing periods are created too, and the rows the
        catch-all took meanwhile move into them.
        """
        uppers = [p.upper for p in self.partitions() if p.upper is not None]
        if not uppers:
            return []
        until = horizon(granularity, now or db_now(self.using))
        if uppers[-1] > until:
            return []
        wanted = [r for r in ranges(granularity, self.zone, uppers[-1], until) if r.upper > uppers[-1]]
        ddl.add_ranges(self.using, ARCHIVE_TABLE, PARTITION_COLUMN, wanted, prefix=ARCHIVE_TABLE, lock_wait=lock_wait)
        return [r.label for r in wanted]

    def droppable(self, before: datetime) -> list[Partition]:
        """The partitions whose every row finished before ``before`` (by their bounds); never the last range."""
        ranged = [p for p in self.partitions() if p.upper is not None]
        return [p for p in ranged[:-1] if p.upper is not None and p.upper <= before]

    def retire_before(self, before: datetime, lock_wait: float | None = None) -> list[Partition]:
        """Take the partitions wholly before ``before`` out of the archive: retention without a row deleted.

        They leave every read of the archive at once; their tables stay
        until `ddl.drop_detached` frees them (the upkeep: `FREED_PER_PASS` a
        pass). Raises `LockNotFree` when the archive's lock was not free
        within ``lock_wait`` seconds (None: waits as long as it takes).
        """
        return self._take_out(self.droppable(before), ddl.detach_partitions, lock_wait)

    def drop_before(self, before: datetime, lock_wait: float | None = None) -> list[Partition]:
        """Drop the partitions wholly before ``before`` now, their tables freed at once (`ddl.drop_partitions`)."""
        return self._take_out(self.droppable(before), ddl.drop_partitions, lock_wait)

    def _take_out(
        self, gone: list[Partition], remove: Callable[..., object], lock_wait: float | None
    ) -> list[Partition]:
        remove(self.using, ARCHIVE_TABLE, [p.name for p in gone], lock_wait=lock_wait)
        return gone


# Detached partitions' tables a reaper pass drops. Each frees its files, at a cost in proportion to its
# size (17 ms for a day of a 10-million-row archive here); one a pass spreads a large retention over passes.
FREED_PER_PASS = 1


def horizon(granularity: str, now: datetime) -> datetime:
    """How far ahead of ``now`` partitions are kept created."""
    return now + timedelta(days=AHEAD[granularity] * (7 if granularity == "weekly" else 1))
