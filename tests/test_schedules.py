"""The scheduler against the database: firing, exactly once, catch-up, overlap, switches, DST, declarations."""

import itertools
import time
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core import checks
from django.test import override_settings

import django_dbqueue
from django_dbqueue.exceptions import ImproperlyConfiguredQueue, InvalidOption
from django_dbqueue.models import Message, Schedule, ScheduleRun, ScheduleTrigger
from django_dbqueue.schedules.registry import declared
from django_dbqueue.schedules.scheduler import Scheduler
from tests.support.schedules import Clock, at

pytestmark = pytest.mark.django_db


def sent(queue):
    return list(Message.objects.filter(queue=queue).order_by("id"))


def slots_sent(queue):
    return [m.headers["schedule_slot"] for m in sent(queue)]


# --- firing ----------------------------------------------------------------------------


def test_a_due_slot_sends_one_message_with_the_slot_in_its_headers(schedules):
    schedules("tick", every=60, queue="s-tick", kind="tock", payload={"x": 1}, priority=-3, headers={"h": "v"})
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    scheduler = Scheduler(clock=clock)
    assert scheduler.run_once().fired == []  # first sight: nothing before counts
    clock.advance(31)
    report = scheduler.run_once()
    [message] = sent("s-tick")
    assert [fired.message.pk for _, fired in report.fired] == [message.pk]
    assert (message.kind, message.payload, message.priority) == ("tock", {"x": 1}, -3)
    assert message.headers == {
        "h": "v",
        "schedule": "tick",
        "schedule_slot": "2026-05-01T10:01:00+00:00",
        "schedule_trigger": "scheduled",
    }
    run = ScheduleRun.objects.get()
    assert (run.schedule_id, run.slot, run.trigger) == ("tick", at(2026, 5, 1, 10, 1), "scheduled")
    assert run.message_id == message.pk
    assert report.next_slot == at(2026, 5, 1, 10, 2)


def test_a_slot_fires_once_however_many_schedulers_try(schedules):
    schedules("tick", every=10, queue="s-tick")
    clock = Clock(at(2026, 5, 1, 10, 0, 5))
    schedulers = [Scheduler(clock=clock, name=f"s{n}") for n in range(3)]
    schedulers[0].run_once()
    clock.advance(10)
    reports = [s.run_once() for s in schedulers]
    assert slots_sent("s-tick") == ["2026-05-01T10:00:10+00:00"]
    assert [len(r.fired) for r in reports] == [1, 0, 0]


def test_the_unique_key_refuses_a_second_firing_of_a_slot_even_by_a_stale_plan(schedules):
    """Two processes that both planned the slot: the second insert finds it taken and sends nothing."""
    schedules("tick", every=10, queue="s-tick")
    clock = Clock(at(2026, 5, 1, 10, 0, 5))
    Scheduler(clock=clock).run_once()
    message = Message(queue="s-tick", payload={}, headers={})
    runs = ScheduleRun.objects
    first = runs.fire("tick", at(2026, 5, 1, 10, 0, 10), "scheduled", message)
    again = runs.fire("tick", at(2026, 5, 1, 10, 0, 10), "scheduled", Message(queue="s-tick", payload={}, headers={}))
    assert first is not None and again is None
    assert Message.objects.filter(queue="s-tick").count() == 1


def test_by_default_now_is_the_database_clock(schedules):
    schedules("tick", every=1, queue="s-tick")
    scheduler = Scheduler()
    first = scheduler.run_once()
    time.sleep(1.2)
    second = scheduler.run_once()
    assert len(second.fired) >= 1
    assert all(fired.slot > first.now for _, fired in second.fired)


# --- catch-up ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("catch_up", "limit", "expected"),
    [
        ("latest", None, [10]),
        ("none", None, []),
        ("all", 4, [7, 8, 9, 10]),
        ("all", 50, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    ],
)
def test_catch_up_after_ten_missed_slots(schedules, catch_up, limit, expected):
    """Stopped for ten 1-second slots, then one pass half a second after the tenth (grace 0.4 s)."""
    fields = {"catch_up": catch_up, "grace": 0.4} | ({"catch_up_limit": limit} if limit else {})
    schedules("tick", every=1, queue="s-tick", **fields)
    clock = Clock(at(2026, 5, 1, 10, 0, 0, 200000))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    clock.advance(10.3)  # 10:00:10.5
    report = scheduler.run_once()
    assert slots_sent("s-tick") == [f"2026-05-01T10:00:{s:02d}+00:00" for s in expected]
    assert {fired.trigger for _, fired in report.fired} <= {"catch-up"}
    assert report.missed.get("tick", 0) == 10 - len(expected)
    # Decided: the next pass fires the next slot only, on time.
    clock.advance(0.8)  # 10:00:11.3
    scheduler.run_once()
    assert slots_sent("s-tick")[len(expected) :] == ["2026-05-01T10:00:11+00:00"]
    assert Schedule.objects.get().covered_until == at(2026, 5, 1, 10, 0, 11)


def test_a_late_pass_within_the_grace_fires_every_slot(schedules):
    schedules("tick", every=1, queue="s-tick", grace=10, catch_up="none")
    clock = Clock(at(2026, 5, 1, 10, 0, 0, 500000))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    clock.advance(4)
    scheduler.run_once()
    assert slots_sent("s-tick") == [f"2026-05-01T10:00:0{s}+00:00" for s in (1, 2, 3, 4)]


# --- overlap, switches, orphans, run now --------------------------------------------------


def test_skip_if_running_skips_while_the_previous_message_is_live(schedules):
    schedules("tick", every=60, queue="s-tick", skip_if_running=True)
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    clock.advance(60)
    scheduler.run_once()  # 10:01 sends
    clock.advance(60)
    report = scheduler.run_once()  # 10:02: the 10:01 message is still live
    [first] = sent("s-tick")
    [(_, skipped)] = report.fired
    assert skipped.message is None and skipped.still_running == first.pk
    assert ScheduleRun.objects.get(slot=at(2026, 5, 1, 10, 2)).skipped_because == first.pk
    [claimed] = django_dbqueue.claim("s-tick")
    assert claimed.ack()
    clock.advance(60)
    scheduler.run_once()  # 10:03: done, so it sends again
    assert slots_sent("s-tick") == ["2026-05-01T10:03:00+00:00"]


def test_a_disabled_schedule_does_not_fire_and_does_not_catch_up_when_enabled(schedules):
    schedules("tick", every=60, queue="s-tick", catch_up="all")
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    assert Schedule.objects.set_enabled("tick", False, by="ops")
    clock.advance(600)
    assert scheduler.run_once().fired == []
    Schedule.objects.filter(pk="tick").update(covered_until=at(2026, 5, 1, 10, 0, 30))  # as it was when disabled
    assert Schedule.objects.set_enabled("tick", True, by="ops")
    assert Schedule.objects.get().covered_until > at(2026, 5, 1, 10, 5)  # from the database clock: now
    assert sent("s-tick") == []
    assert not Schedule.objects.set_enabled("nope", True)


def test_an_orphaned_schedule_is_never_fired(schedules):
    schedules("tick", every=60, queue="s-tick")
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    Scheduler(clock=clock).run_once()
    from django_dbqueue.schedules import registry

    registry.forget("tick")  # removed from the code; its row stays
    clock.advance(3600)
    assert Scheduler(clock=clock).run_once().fired == []
    assert Schedule.objects.filter(pk="tick").exists() and sent("s-tick") == []
    with pytest.raises(InvalidOption, match="not declared"):
        Scheduler(clock=clock).run_now("tick")


def test_run_now_sends_off_the_slots_and_leaves_them_alone(schedules):
    schedules("tick", every=3600, queue="s-tick", skip_if_running=True)
    clock = Clock(at(2026, 5, 1, 10, 20))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    covered = Schedule.objects.get().covered_until
    first = scheduler.run_now("tick", by="ops")
    second = scheduler.run_now("tick", by="ops") if clock.advance(1) else None  # skip_if_running does not apply
    assert first.message is not None and second.message is not None
    assert [m.headers["schedule_trigger"] for m in sent("s-tick")] == ["manual", "manual"]
    assert ScheduleRun.objects.filter(trigger=ScheduleTrigger.MANUAL, fired_by="ops").count() == 2
    assert Schedule.objects.get().covered_until == covered


# --- time zones and DST -------------------------------------------------------------------


def walk(scheduler, clock, until, step):
    while clock.now < until:
        clock.advance(step)
        scheduler.run_once()


def test_a_daily_0230_in_berlin_fires_once_on_the_spring_gap_day(schedules):
    schedules("nightly", cron="30 2 * * *", timezone="Europe/Berlin", queue="s-night")
    clock = Clock(at(2026, 3, 28, 12))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    walk(scheduler, clock, at(2026, 3, 30, 12), step=300)  # a pass every 5 minutes for two days
    # 28 Mar: no slot after noon; 29 Mar (no 02:30 that night): 03:00 CEST; 30 Mar: 02:30 CEST.
    assert slots_sent("s-night") == ["2026-03-29T01:00:00+00:00", "2026-03-30T00:30:00+00:00"]


def test_a_daily_0230_in_berlin_fires_once_on_the_fall_back_day(schedules):
    schedules("nightly", cron="30 2 * * *", timezone="Europe/Berlin", queue="s-night")
    clock = Clock(at(2026, 10, 24, 12))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    walk(scheduler, clock, at(2026, 10, 26, 12), step=300)
    # 25 Oct: 02:30 CEST (the first of the two 02:30s) only; 26 Oct: 02:30 CET.
    assert slots_sent("s-night") == ["2026-10-25T00:30:00+00:00", "2026-10-26T01:30:00+00:00"]


NIGHTLY_ACROSS_DST = [
    # (zone, expression, a noon two days before the change): the slot falls in the gap or the repeated hour.
    pytest.param("Europe/Berlin", "30 2 * * *", at(2026, 10, 23, 10), id="Berlin-autumn"),
    pytest.param("Europe/Berlin", "30 2 * * *", at(2026, 3, 27, 11), id="Berlin-spring"),
    pytest.param("America/New_York", "30 1 * * *", at(2026, 10, 30, 16), id="New_York-autumn"),
    pytest.param("America/New_York", "30 2 * * *", at(2026, 3, 6, 17), id="New_York-spring"),
    pytest.param("Australia/Sydney", "30 2 * * *", at(2026, 4, 3, 1), id="Sydney-autumn"),
    pytest.param("America/Santiago", "30 23 * * *", at(2026, 4, 2, 15), id="Santiago-autumn"),
]


@pytest.mark.parametrize(("zone", "expression", "start"), NIGHTLY_ACROSS_DST)
def test_passes_through_a_dst_change_always_wait_for_a_later_slot_and_fire_each_night_once(
    schedules, zone, expression, start
):
    """The bug: in the repeated hour the next slot was a past one, and every scheduler looped every 10 ms."""
    schedules("nightly", cron=expression, timezone=zone, queue="s-night")
    clock = Clock(start)
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    while clock.now < start + timedelta(days=4):
        clock.advance(600)  # a pass every 10 minutes for four days
        report = scheduler.run_once()
        assert report.next_slot > report.now, (report.now, report.next_slot)
    nights = [datetime.fromisoformat(slot).astimezone(ZoneInfo(zone)).date() for slot in slots_sent("s-night")]
    assert len(nights) == 4 and all(b - a == timedelta(days=1) for a, b in itertools.pairwise(nights))


BACK_AFTER_MISSING_THE_NIGHTS_SLOT = [
    # (zone, expression, the night's slot, back at, the next night's slot): down from two hours before the slot.
    # Back in the repeated hour's second pass, after its first pass's slot:
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        at(2026, 10, 25, 0, 30),
        at(2026, 10, 25, 1, 10),
        at(2026, 10, 26, 1, 30),
        id="Berlin-autumn",
    ),
    pytest.param(
        "America/New_York",
        "30 1 * * *",
        at(2026, 11, 1, 5, 30),
        at(2026, 11, 1, 6, 10),
        at(2026, 11, 2, 6, 30),
        id="New_York-autumn",
    ),
    pytest.param(
        "Australia/Sydney",
        "30 2 * * *",
        at(2026, 4, 4, 15, 30),
        at(2026, 4, 4, 16, 10),
        at(2026, 4, 5, 16, 30),
        id="Sydney-autumn",
    ),
    pytest.param(
        "America/Santiago",
        "30 23 * * *",
        at(2026, 4, 5, 2, 30),
        at(2026, 4, 5, 3, 10),
        at(2026, 4, 6, 3, 30),
        id="Santiago-autumn",
    ),
    # Back just after the spring gap, whose slot is the first moment after it:
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        at(2026, 3, 29, 1),
        at(2026, 3, 29, 1, 10),
        at(2026, 3, 30, 0, 30),
        id="Berlin-spring",
    ),
    pytest.param(
        "America/New_York",
        "30 2 * * *",
        at(2026, 3, 8, 7),
        at(2026, 3, 8, 7, 10),
        at(2026, 3, 9, 6, 30),
        id="New_York-spring",
    ),
]


@pytest.mark.parametrize("catch_up", ["latest", "all"])
@pytest.mark.parametrize(("zone", "expression", "slot", "back", "following"), BACK_AFTER_MISSING_THE_NIGHTS_SLOT)
def test_a_scheduler_back_after_a_dst_nights_slot_catches_it_up_once(
    schedules, catch_up, zone, expression, slot, back, following
):
    """Before the fix, back in Berlin's second 02:xx (01:10 UTC) nothing was due: 25 October's slot was skipped."""
    schedules("nightly", cron=expression, timezone=zone, queue="s-night", catch_up=catch_up)
    clock = Clock(slot - timedelta(hours=12))
    scheduler = Scheduler(clock=clock)
    walk(scheduler, clock, slot - timedelta(hours=2), step=600)
    assert slots_sent("s-night") == []
    clock.now = back
    report = scheduler.run_once()
    assert [(fired.slot, fired.trigger) for _, fired in report.fired] == [(slot, "catch-up")]
    assert report.next_slot == following
    walk(scheduler, clock, following + timedelta(hours=12), step=300)
    assert slots_sent("s-night") == [slot.isoformat(), following.isoformat()]


# --- declarations ---------------------------------------------------------------------------


def test_schedule_above_handler_takes_the_handlers_queue_and_kind(schedules):
    from django_dbqueue import handlers

    @django_dbqueue.schedule("0 * * * *", name="digest", payload={"n": 1})
    @django_dbqueue.handler("s-handled", kind="digest")
    def digest(message): ...

    try:
        specs, problems = declared()
        spec = specs["digest"]
        assert (spec.queue, spec.kind, spec.payload, problems) == ("s-handled", "digest", {"n": 1}, [])
    finally:
        handlers.unregister("s-handled", "digest")


def test_a_bad_declaration_in_code_is_a_check_error_naming_schedule_and_field(schedules):
    schedules("broken", cron="0 25 * * *", queue="s-tick")
    schedules("no-queue", every=60)
    errors = [e for e in checks.run_checks(databases=[]) if e.id == "django_dbqueue.E003"]
    assert sorted(e.msg for e in errors) == [
        "schedule 'broken' (declared on tests.support.schedules.declared_broken): "
        "cron has a bad hour field '25' in '0 25 * * *'",
        "schedule 'no-queue' (declared on tests.support.schedules.declared_no-queue): "
        "queue is missing: name the queue the messages go to (or put @schedule above @handler)",
    ]
    with pytest.raises(ImproperlyConfiguredQueue, match="bad hour field"):
        Scheduler().run_once()


SETTINGS_SCHEDULES = {
    "nightly-report": {"CRON": "15 3 * * *", "TIMEZONE": "America/New_York", "QUEUE": "s-reports", "KIND": "nightly"},
    "heartbeat": {"EVERY": timedelta(minutes=5), "QUEUE": "s-beat", "CATCH_UP": "none"},
}


def test_schedules_from_settings():
    with override_settings(DBQUEUE={"SCHEDULES": SETTINGS_SCHEDULES}):
        specs, problems = declared()
        assert problems == []
        assert specs["nightly-report"].describe() == "cron 15 3 * * * (America/New_York)"
        assert (specs["heartbeat"].describe(), specs["heartbeat"].catch_up) == ("every 5m", "none")
        clock = Clock(at(2026, 5, 1, 7, 0, 30))
        scheduler = Scheduler(clock=clock)
        scheduler.run_once()
        clock.advance(3 * 3600 + 150)  # 10:03 UTC: past 03:15 in New York (07:15 UTC), and many heartbeats
        scheduler.run_once()
        assert slots_sent("s-reports") == ["2026-05-01T07:15:00+00:00"]
        assert slots_sent("s-beat") == []  # all missed (grace 60 s), and "none" catches none up


def test_a_bad_schedule_setting_is_e001_naming_schedule_and_field():
    bad = {"r": {"CRON": "0 3 * * FOO", "QUEUE": "q"}, "s": {"EVERY": 60, "QUEUE": "q", "CATCH_UP": "some"}}
    with override_settings(DBQUEUE={"SCHEDULES": bad}):
        errors = sorted(e.msg for e in checks.run_checks(databases=[]) if e.id == "django_dbqueue.E001")
    assert errors == [
        "DBQUEUE['SCHEDULES']['r']['CRON'] has a bad day-of-week field 'FOO' in '0 3 * * FOO'",
        "DBQUEUE['SCHEDULES']['s']['CATCH_UP'] must be one of 'latest', 'none', 'all', not 'some'",
    ]


def test_old_runs_are_pruned_but_each_schedules_newest_stays(schedules):
    schedules("tick", every=60, queue="s-tick")
    clock = Clock(at(2026, 5, 1, 10, 0, 30))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    for _ in range(3):
        clock.advance(60)
        scheduler.run_once()
    assert ScheduleRun.objects.count() == 3
    clock.advance(30 * 86400)
    assert scheduler.prune(clock.now) == 2
    assert list(ScheduleRun.objects.values_list("slot", flat=True)) == [at(2026, 5, 1, 10, 3)]
