"""Slots of cron expressions and intervals, and the catch-up plans made from them: pure computation."""

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from django_dbqueue.schedules.policy import ALL, CATCH_UP, LATEST, NONE, ON_TIME, plan
from django_dbqueue.schedules.timing import Cron, Interval, cron_problem, latest_slots, slots_between

BERLIN = ZoneInfo("Europe/Berlin")


def utc(*args):
    return datetime(*args, tzinfo=UTC)


# --- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "field", "value"),
    [
        ("61 * * * *", "minute", "61"),
        ("* 24 * * *", "hour", "24"),
        ("* * 32 * *", "day-of-month", "32"),
        ("* * * 13 *", "month", "13"),
        ("* * * JANUARY *", "month", "JANUARY"),
        ("* * * * 8", "day-of-week", "8"),
        ("*/0 * * * *", "minute", "*/0"),
        ("5-1 * * * *", "minute", "5-1"),
    ],
)
def test_a_bad_field_is_named(expression, field, value):
    assert cron_problem(expression) == f"has a bad {field} field {value!r} in {expression!r}"


@pytest.mark.parametrize("expression", ["* * * *", "* * * * * *", ""])
def test_five_fields_or_a_shorthand(expression):
    assert "a cron expression has five" in cron_problem(expression)


def test_unknown_shorthand_and_impossible_dates():
    assert "unknown shorthand '@reboot'" in cron_problem("@reboot")
    assert cron_problem("0 0 30 2 *") == "has a bad day-of-month field '30' in '0 0 30 2 *'"
    assert cron_problem(5) == "must be a cron expression such as '*/5 * * * *', not int"


@pytest.mark.parametrize(
    "expression",
    ["*/5 * * * *", "0 9-17 * * MON-FRI", "30 2 1,15 JAN,JUL *", "0 0 * * sun", "@hourly", "@daily", "@weekly"],
)
def test_ranges_steps_lists_names_and_shorthands(expression):
    assert cron_problem(expression) is None


def test_names_and_shorthands_mean_what_they_say():
    weekdays = Cron("0 9 * * MON-FRI")
    slots = slots_between(weekdays, utc(2026, 6, 5, 12), utc(2026, 6, 9, 12), 10)  # Friday noon to Tuesday noon
    assert slots == [utc(2026, 6, 8, 9), utc(2026, 6, 9, 9)]
    assert Cron("@hourly").next_after(utc(2026, 6, 5, 12, 0, 1)) == utc(2026, 6, 5, 13)
    assert Cron("@daily").next_after(utc(2026, 6, 5, 12)) == utc(2026, 6, 6)


# --- slots -----------------------------------------------------------------------------


def test_cron_slots_are_read_in_their_time_zone_and_returned_in_utc():
    nine = Cron("0 9 * * *", "Europe/Berlin")
    assert nine.next_after(utc(2026, 1, 10)) == utc(2026, 1, 10, 8)  # CET: UTC+1
    assert nine.next_after(utc(2026, 7, 10)) == utc(2026, 7, 10, 7)  # CEST: UTC+2


def test_latest_until_counts_a_slot_at_that_very_moment():
    every_5 = Cron("*/5 * * * *")
    assert every_5.latest_until(utc(2026, 1, 1, 10, 5)) == utc(2026, 1, 1, 10, 5)
    assert every_5.latest_until(utc(2026, 1, 1, 10, 4, 59, 999999)) == utc(2026, 1, 1, 10, 0)
    assert every_5.next_after(utc(2026, 1, 1, 10, 5)) == utc(2026, 1, 1, 10, 10)


def test_intervals_sit_on_one_grid_from_the_epoch():
    minute = Interval(60)
    assert minute.next_after(utc(2026, 1, 1, 10, 0, 30)) == utc(2026, 1, 1, 10, 1)
    assert minute.latest_until(utc(2026, 1, 1, 10, 0, 30)) == utc(2026, 1, 1, 10, 0)
    assert minute.latest_until(utc(2026, 1, 1, 10, 1)) == utc(2026, 1, 1, 10, 1)
    assert Interval(86400).next_after(utc(2026, 1, 1, 10)) == utc(2026, 1, 2)


# --- daylight saving time ---------------------------------------------------------------
# Europe/Berlin: 2026-03-29 02:00 CET -> 03:00 CEST (02:xx does not exist);
# 2026-10-25 03:00 CEST -> 02:00 CET (02:xx happens twice).


def test_a_daily_slot_in_the_spring_gap_fires_once_right_after_the_gap():
    daily = Cron("30 2 * * *", "Europe/Berlin")
    slots = slots_between(daily, utc(2026, 3, 27, 12), utc(2026, 3, 31, 12), 10)
    local = [slot.astimezone(BERLIN).strftime("%m-%d %H:%M %Z") for slot in slots]
    assert local == ["03-28 02:30 CET", "03-29 03:00 CEST", "03-30 02:30 CEST", "03-31 02:30 CEST"]


def test_a_daily_slot_in_the_repeated_hour_fires_once_at_its_first_occurrence():
    daily = Cron("30 2 * * *", "Europe/Berlin")
    slots = slots_between(daily, utc(2026, 10, 24, 12), utc(2026, 10, 26, 12), 10)
    local = [slot.astimezone(BERLIN).strftime("%m-%d %H:%M %Z") for slot in slots]
    assert local == ["10-25 02:30 CEST", "10-26 02:30 CET"]


def test_hourly_jobs_follow_real_time_across_dst():
    hourly = Cron("0 * * * *", "Europe/Berlin")
    spring = slots_between(hourly, utc(2026, 3, 28, 23), utc(2026, 3, 29, 23), 100)  # the local day of 23 hours
    autumn = slots_between(hourly, utc(2026, 10, 24, 22), utc(2026, 10, 25, 23), 100)  # the local day of 25 hours
    assert len(spring) == 24 and len(autumn) == 25
    assert all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(autumn))


@pytest.mark.parametrize("expression", ["30 2 * * *", "0 * * * *", "*/20 1-3 * * *", "45 2 * * SUN", "0 3 * * *"])
@pytest.mark.parametrize("start", [utc(2026, 3, 27), utc(2026, 10, 23)])
def test_walking_back_finds_the_same_slots_as_walking_forward(expression, start):
    """Missed slots are found walking back from now: they must be the very slots the forward walk fires."""
    timing = Cron(expression, "Europe/Berlin")
    end = start + timedelta(days=4)
    forward = slots_between(timing, start, end, 10_000)
    assert latest_slots(timing, start, end, 10_000) == forward


# Every transition of 2026 in zones that change at 01:00 UTC, at local 02:00 (north and south), at
# midnight (America/Santiago) and by half an hour (Australia/Lord_Howe); the first instant of each new offset.
TRANSITIONS = [
    ("Europe/Berlin", utc(2026, 3, 29, 1), utc(2026, 10, 25, 1)),
    ("America/New_York", utc(2026, 3, 8, 7), utc(2026, 11, 1, 6)),
    ("Australia/Sydney", utc(2026, 10, 3, 16), utc(2026, 4, 4, 16)),
    ("America/Santiago", utc(2026, 9, 6, 4), utc(2026, 4, 5, 3)),
    ("Australia/Lord_Howe", utc(2026, 10, 3, 15, 30), utc(2026, 4, 4, 15)),
]
DST_CHANGES = [
    pytest.param(zone, change, id=f"{zone}-{season}")
    for zone, spring, autumn in TRANSITIONS
    for season, change in (("spring", spring), ("autumn", autumn))
]
# Fixed local times (one or several a day) in and around every zone's gap and repeated hour ...
FIXED = ["30 2 * * *", "30 1 * * *", "45 1 * * *", "30 23 * * *", "30 0 * * *", "0,30 2 * * *", "15,45 1,2 * * *"]
DAILY = [expression for expression in FIXED if "," not in expression]
# ... and expressions that follow real time. cronsim walks those wrongly across Lord Howe's half-hour
# change (it skips 02:00 on the autumn day), so they are checked in the whole-hour zones only.
REAL_TIME = ["0 * * * *", "*/20 1-3 * * *", "*/15 2 * * *", "0 */2 * * *"]


def moments_around(change, hours=8, step=timedelta(minutes=10)):
    """Every ``step`` from ``hours`` before a DST change to ``hours`` after; also 1 s after and 1 µs before each."""
    moment = change - timedelta(hours=hours)
    while moment <= change + timedelta(hours=hours):
        yield from (moment, moment + timedelta(seconds=1), moment - timedelta(microseconds=1))
        moment += step


@pytest.mark.parametrize(("zone", "change"), DST_CHANGES)
def test_next_slot_is_always_after_now_and_latest_at_or_before_it_across_dst(zone, change):
    """The bug: inside a repeated hour the next slot of ``30 2 * * *`` was the first 02:30, already past."""
    expressions = FIXED + (REAL_TIME if zone != "Australia/Lord_Howe" else [])
    for expression in expressions:
        timing = Cron(expression, zone)
        for moment in moments_around(change):
            following, latest = timing.next_after(moment), timing.latest_until(moment)
            where = (expression, moment.isoformat(), following, latest)
            assert following is not None and following > moment, where
            assert latest is not None and latest <= moment, where
            # Adjacent: no slot between the latest and the next (one walked forward, the other back).
            assert timing.next_after(latest) == following, where
            assert timing.latest_until(following - timedelta(microseconds=1)) == latest, where


@pytest.mark.parametrize(("zone", "change"), DST_CHANGES)
@pytest.mark.parametrize("expression", DAILY)
def test_a_daily_fixed_time_has_one_slot_each_local_day_across_dst(zone, change, expression):
    timing = Cron(expression, zone)
    start, end = change - timedelta(days=2), change + timedelta(days=2)
    forward = slots_between(timing, start, end, 100)
    assert latest_slots(timing, start, end, 100) == forward
    days = [slot.astimezone(ZoneInfo(zone)).date() for slot in forward]
    assert len(days) == len(set(days)) >= 3
    assert all(b - a == timedelta(days=1) for a, b in itertools.pairwise(days))


def test_inside_berlins_repeated_hour_the_next_0230_is_tomorrows():
    daily = Cron("30 2 * * *", "Europe/Berlin")
    for minute in (0, 15, 29, 30, 45):  # 02:xx CET, the second pass of the hour
        now = utc(2026, 10, 25, 1, minute)
        assert daily.next_after(now) == utc(2026, 10, 26, 1, 30)
        assert daily.latest_until(now) == utc(2026, 10, 25, 0, 30)  # the first pass's 02:30 CEST
    assert daily.next_after(utc(2026, 10, 25, 0, 15)) == utc(2026, 10, 25, 0, 30)  # first pass: still to come


# --- catch-up plans ----------------------------------------------------------------------


def every_second_after_downtime(catch_up, limit=1):
    """Slots decided up to 10:00:00; nothing ran for 10 slots; now is 10:00:10.5, grace 0.4 s."""
    return plan(
        Interval(1),
        utc(2026, 1, 1, 10),
        utc(2026, 1, 1, 10, 0, 10, 500000),
        grace=timedelta(seconds=0.4),
        catch_up=catch_up,
        limit=limit,
    )


def test_latest_fires_the_most_recent_missed_slot_once():
    decided = every_second_after_downtime(LATEST)
    assert decided.fire == [(utc(2026, 1, 1, 10, 0, 10), CATCH_UP)]
    assert decided.missed == 9
    assert decided.covered_until == utc(2026, 1, 1, 10, 0, 10)


def test_none_fires_no_missed_slot():
    decided = every_second_after_downtime(NONE)
    assert decided.fire == []
    assert decided.missed == 10
    assert decided.covered_until == utc(2026, 1, 1, 10, 0, 10)


def test_all_fires_the_most_recent_missed_slots_up_to_the_limit():
    decided = every_second_after_downtime(ALL, limit=4)
    assert decided.fire == [(utc(2026, 1, 1, 10, 0, s), CATCH_UP) for s in (7, 8, 9, 10)]
    assert decided.missed == 6
    assert every_second_after_downtime(ALL, limit=100).missed == 0


def test_slots_within_the_grace_are_on_time_whatever_the_policy():
    for catch_up in (LATEST, NONE, ALL):
        decided = plan(
            Interval(1),
            utc(2026, 1, 1, 10),
            utc(2026, 1, 1, 10, 0, 3, 200000),
            grace=timedelta(seconds=5),
            catch_up=catch_up,
        )
        assert decided.fire == [(utc(2026, 1, 1, 10, 0, s), ON_TIME) for s in (1, 2, 3)]
        assert decided.missed == 0


def test_nothing_due_before_the_next_slot():
    decided = plan(Interval(60), utc(2026, 1, 1, 10), utc(2026, 1, 1, 10, 0, 59), grace=timedelta(seconds=60))
    assert decided.nothing_due and decided.fire == []


def test_a_year_of_downtime_costs_a_few_steps():
    decided = plan(
        Cron("* * * * *"), utc(2025, 1, 1), utc(2026, 1, 1, 0, 0, 30), grace=timedelta(seconds=60), catch_up=LATEST
    )
    assert decided.fire == [(utc(2025, 12, 31, 23, 59), CATCH_UP), (utc(2026, 1, 1), ON_TIME)]
    assert decided.missed == 999 and decided.missed_more  # counted up to a cap: "at least 999"
