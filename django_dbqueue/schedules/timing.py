"""When a schedule's slots fall: a five-field cron expression in a time zone, or a fixed interval.

Pure computation over aware datetimes, no database and no clock: callers
pass "now" (the database's, see `django_dbqueue.schedules.scheduler`).
Every process must compute the same slots from the same declaration, since
a slot's time is half of the key that makes it fire once; so slots are
always returned in UTC, and an interval is anchored at the Unix epoch, not
at whenever a process started.

Cron expressions are parsed and walked by cronsim (docs/schedules.md says
why that library). Its DST rules follow Debian's cron: a job at a fixed
local time that falls into a spring-forward gap runs at the first moment
after the gap; one that falls into the repeated hour of a fall-back runs
once, at the first of the two; jobs with ``*`` in the minute or hour field
follow real time (an hourly job runs 23 or 25 times that day). cronsim
walks a fixed time in wall-clock time, so asked from the second pass of a
repeated hour it answers with that hour's first pass, already gone:
`Cron.next_after` and `Cron.latest_until` correct for it, so the
next slot is always later than the moment asked about (docs/schedules.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol, cast
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

# The shorthands of crontab(5), each a plain five-field expression (``@reboot`` has no meaning here).
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_MICROSECOND = timedelta(microseconds=1)


class Timing(Protocol):
    """What the scheduler needs to know about when a schedule fires."""

    def next_after(self, moment: datetime) -> datetime | None:
        """The first slot strictly after ``moment`` (UTC), or None if there is none."""

    def latest_until(self, moment: datetime) -> datetime | None:
        """The last slot at or before ``moment`` (UTC), or None if there is none."""

    def describe(self) -> str:
        """A short text for the admin and ``queuestats``."""


def expand(expression: str) -> str:
    """``@daily`` and friends as five fields; any other expression unchanged (but stripped)."""
    text = expression.strip()
    return MACROS.get(text.lower(), text)


def cron_problem(expression: object) -> str | None:
    """Why ``expression`` is not a five-field cron expression, naming the bad field; or None."""
    if not isinstance(expression, str):
        return f"must be a cron expression such as '*/5 * * * *', not {type(expression).__name__}"
    text = expression.strip()
    if text.startswith("@") and text.lower() not in MACROS:
        return f"has an unknown shorthand {text!r}; known: {', '.join(MACROS)}"
    fields = expand(text).split()
    if len(fields) != len(FIELDS):
        return (
            f"{expression!r} has {len(fields)} field(s); a cron expression has five: "
            f"{' '.join(FIELDS)} (or a shorthand such as @hourly)"
        )
    try:
        slots = CronSim(" ".join(fields), datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        # cronsim names the field ("Bad day-of-week"); with a 5-field expression
        # it prepends a seconds field, so its names line up with ours.
        name = str(exc).removeprefix("Bad ").strip()
        if name in FIELDS:
            return f"has a bad {name} field {fields[FIELDS.index(name)]!r} in {expression!r}"
        return f"{expression!r} is not a valid cron expression ({exc})"
    try:
        next(slots)
    except StopIteration:
        return f"{expression!r} never fires (no such date in 50 years)"
    return None


def timezone_problem(name: object) -> str | None:
    """Why ``name`` is not an IANA time zone name that this machine knows; or None."""
    if not isinstance(name, str) or not name:
        return f"must be an IANA time zone name such as 'Europe/Berlin', not {name!r}"
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return f"{name!r} is not a time zone this machine knows (an IANA name such as 'Europe/Berlin')"
    return None


@dataclass(frozen=True)
class Cron:
    """Slots at the times a cron expression names, read in the wall-clock time of ``timezone``."""

    expression: str
    timezone: str = "UTC"

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def next_after(self, moment: datetime) -> datetime | None:
        # cronsim walks a fixed-time expression in wall-clock time and places a
        # slot of a repeated hour at its first pass: started in the second pass,
        # it returns slots of that hour which are already past. Skip them.
        for slot in CronSim(expand(self.expression), moment.astimezone(self.zone)):
            if slot.astimezone(UTC) > moment:
                return slot.astimezone(UTC)
        return None

    def latest_until(self, moment: datetime) -> datetime | None:
        local = moment.astimezone(self.zone)
        if local.fold:
            # In the second pass of a repeated hour, every slot placed at that
            # hour's first pass is already past, the later wall-clock times
            # included: walk back from the end of the repeated hour instead.
            repeated = cast(timedelta, local.replace(fold=0).utcoffset()) - cast(timedelta, local.utcoffset())
            local = (moment + repeated).astimezone(self.zone)
        # cronsim walks backwards from the whole second below a time with
        # microseconds, that second included: so a slot at exactly ``moment`` counts.
        start = local if local.microsecond else local.replace(microsecond=1)
        for slot in CronSim(expand(self.expression), start, reverse=True):
            if slot.astimezone(UTC) <= moment:
                return slot.astimezone(UTC)
        return None

    def describe(self) -> str:
        return f"cron {self.expression} ({self.timezone})"


@dataclass(frozen=True)
class Interval:
    """A slot every ``seconds``, at whole multiples since the Unix epoch (UTC).

    Anchoring at the epoch keeps every process on one grid: ``every=3600`` fires
    on the hour (UTC), ``every=86400`` at midnight UTC.
    """

    seconds: int

    def _index(self, moment: datetime) -> int:
        """How many whole intervals lie between the epoch and ``moment`` (floor)."""
        return (moment - EPOCH) // timedelta(seconds=self.seconds)

    def next_after(self, moment: datetime) -> datetime:
        return EPOCH + (self._index(moment) + 1) * timedelta(seconds=self.seconds)

    def latest_until(self, moment: datetime) -> datetime:
        return EPOCH + self._index(moment) * timedelta(seconds=self.seconds)

    def describe(self) -> str:
        return f"every {format_seconds(self.seconds)}"


def slots_between(timing: Timing, after: datetime, until: datetime, limit: int) -> list[datetime]:
    """The slots in ``(after, until]``, oldest first, at most ``limit`` of the oldest."""
    found: list[datetime] = []
    slot = timing.next_after(after)
    while slot is not None and slot <= until and len(found) < limit:
        found.append(slot)
        slot = timing.next_after(slot)
    return found


def latest_slots(timing: Timing, after: datetime, until: datetime, limit: int) -> list[datetime]:
    """The newest ``limit`` slots in ``(after, until]``, oldest first: walks back from ``until`` only."""
    found: list[datetime] = []
    slot = timing.latest_until(until)
    while slot is not None and slot > after and len(found) < limit:
        found.append(slot)
        slot = timing.latest_until(slot - ONE_MICROSECOND)
    return found[::-1]


def format_seconds(seconds: float) -> str:
    """``90`` -> ``1m 30s``, ``86400`` -> ``1d``: an interval in words a person reads at a glance."""
    whole = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts) or f"{seconds}s"
