"""Which of a schedule's due slots fire: on time, or missed and subject to the catch-up policy.

Pure: given the schedule's timing, the time up to which its slots are
decided (``covered_until``, kept in the database) and "now" (the
database's), `plan` says what to fire. A slot is *on time* while it
is at most ``grace`` old: a scheduler that woke a little late still fires
it. An older one was *missed* (no scheduler ran then), and the catch-up
policy decides:

- ``latest`` fires the most recent missed slot, once;
- ``none`` fires none of them;
- ``all`` fires the most recent ``limit`` of them, oldest first.

Missed slots are found by walking back from now, never forward from the
last run, so a year of downtime costs no more than an hour of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .timing import Timing, latest_slots, slots_between

LATEST, NONE, ALL = "latest", "none", "all"
CATCH_UP_POLICIES = (LATEST, NONE, ALL)

ON_TIME, CATCH_UP = "scheduled", "catch-up"

# On-time slots fired in one pass at most (a 1-second schedule with a long grace
# after a stall); the rest wait for the next pass, which comes at once.
MAX_ON_TIME = 1000
# How far back missed slots are counted for the log.
MISSED_COUNT_CAP = 1000


@dataclass
class Plan:
    """What one pass does for one schedule."""

    fire: list[tuple[datetime, str]] = field(default_factory=list)  # (slot, ON_TIME or CATCH_UP), oldest first
    missed: int = 0  # missed slots left unfired (counted up to MISSED_COUNT_CAP)
    missed_more: bool = False  # there may be more than ``missed``: the count hit its cap
    covered_until: datetime | None = None  # the newest slot decided by this plan; None: nothing was due

    @property
    def nothing_due(self) -> bool:
        return self.covered_until is None


def plan(
    timing: Timing,
    covered_until: datetime,
    now: datetime,
    *,
    grace: timedelta,
    catch_up: str = LATEST,
    limit: int = 1,
) -> Plan:
    """Decide the slots in ``(covered_until, now]``."""
    newest = timing.latest_until(now)
    if newest is None or newest <= covered_until:
        return Plan()
    on_time_after = max(covered_until, now - grace)
    on_time = slots_between(timing, on_time_after, now, MAX_ON_TIME)
    result = Plan(covered_until=on_time[-1] if on_time else newest)
    if on_time_after > covered_until:  # some of the window lies beyond the grace: missed slots
        wanted = {LATEST: 1, NONE: 0, ALL: limit}[catch_up]
        missed = latest_slots(timing, covered_until, on_time_after, wanted + 1)  # one more: are any left out?
        fired = missed[-wanted:] if wanted else []
        result.fire += [(slot, CATCH_UP) for slot in fired]
        if len(missed) > len(fired):
            counted = latest_slots(timing, covered_until, on_time_after, MISSED_COUNT_CAP)
            result.missed = len(counted) - len(fired)
            result.missed_more = len(counted) == MISSED_COUNT_CAP
    result.fire += [(slot, ON_TIME) for slot in on_time]
    return result
