"""Schedulers in real OS processes on the real database clock: once per slot, none missing; catch-up on restart."""

import itertools
import json
import re
import signal
import time
from collections import Counter
from datetime import timedelta

import pytest

from django_dbqueue.models import ArchivedMessage, Message, ScheduleRun
from tests.support.processes import start_command, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def schedulers(schedules: dict, *args: object):
    return start_command("runqueueschedules", *args, DBQUEUE_TEST_SCHEDULES=json.dumps(schedules))


def finish(process, timeout: float = 120) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"runqueueschedules exited {process.returncode}:\n{stderr[-4000:]}"
    return stdout


CATCH_UP = {
    "s-latest": {"EVERY": 1, "QUEUE": "s-latest", "GRACE": 0.5, "CATCH_UP": "latest"},
    "s-none": {"EVERY": 1, "QUEUE": "s-none", "GRACE": 0.5, "CATCH_UP": "none"},
    "s-all": {"EVERY": 1, "QUEUE": "s-all", "GRACE": 0.5, "CATCH_UP": "all", "CATCH_UP_LIMIT": 4},
}


@pytest.mark.slow
def test_stopped_for_10_slots_each_catch_up_policy_does_what_it_promises():
    loop = schedulers(CATCH_UP)
    wait_for(lambda: all(ScheduleRun.objects.filter(schedule_id=n).count() >= 2 for n in CATCH_UP), what="firing")
    loop.send_signal(signal.SIGTERM)
    finish(loop)
    last = {name: ScheduleRun.objects.filter(schedule_id=name).latest("slot").slot for name in CATCH_UP}
    time.sleep(10.5)  # ten slots go by with no scheduler
    once = schedulers(CATCH_UP, "--once")
    output = finish(once)
    by_restart = {
        name: list(ScheduleRun.objects.filter(schedule_id=name, slot__gt=last[name]).order_by("slot"))
        for name in CATCH_UP
    }
    assert all(run.fired_by.endswith(f":{once.pid}") for runs in by_restart.values() for run in runs), output

    def caught_up(name):
        return [run for run in by_restart[name] if run.trigger == "catch-up"]

    # One pass decided all three at one "now": "latest" fired the newest missed slot, once ...
    [latest] = caught_up("s-latest")
    newest_missed = latest.slot
    assert newest_missed - max(last.values()) >= timedelta(seconds=9)  # about ten slots were missed
    assert latest.fired_at - timedelta(seconds=2) <= newest_missed < latest.fired_at - timedelta(seconds=0.5)
    # ... "all" the newest four missed slots (its CATCH_UP_LIMIT), and "none" none.
    assert [run.slot for run in caught_up("s-all")] == [newest_missed - timedelta(seconds=n) for n in (3, 2, 1, 0)]
    assert caught_up("s-none") == []
    for name in CATCH_UP:  # beside those, at most the slot that was on time at the restart
        assert len(by_restart[name]) - len(caught_up(name)) <= 1
        assert all(run.trigger in ("catch-up", "scheduled") for run in by_restart[name])
        assert Message.objects.filter(queue=name, headers__schedule_trigger="catch-up").count() == len(caught_up(name))
    assert "s-none: passed over" in output and "s-all: passed over" in output


@pytest.mark.slow
def test_every_worker_fires_schedules_unless_told_not_to():
    tick = json.dumps({"tick": {"EVERY": 1, "QUEUE": "w-ok", "GRACE": 10}})
    worker = start_worker("w-ok", "--max-runtime", 5, DBQUEUE_TEST_SCHEDULES=tick)
    opted_out = start_worker("w-ok", "--max-runtime", 5, "--no-schedules", DBQUEUE_TEST_SCHEDULES=tick)
    for process in (worker, opted_out):
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr[-4000:]
    runs = list(ScheduleRun.objects.filter(schedule_id="tick"))
    assert len(runs) >= 2
    assert {run.fired_by.rsplit(":", 1)[1] for run in runs} == {str(worker.pid)}
    # The workers ran the scheduled messages too: the handler's return value is in the archive.
    done = ArchivedMessage.objects.filter(queue="w-ok", headers__schedule="tick")
    assert done.count() >= 1


RETRIED = re.compile(r"hit (.*); retry \d+ of \d+")


@pytest.mark.slow
def test_4_schedulers_on_3_schedules_fire_each_slot_once_none_missing_and_never_deadlock():
    """Four schedulers race on three 1-second schedules for 15 seconds: each slot fires once, none is missed.

    MariaDB deadlocked competing schedulers several times a minute (error
    1213): each firing inserted its run row, whose foreign key check took a
    shared lock on the schedule's row, then updated that row, and two firers
    of a slot holding the shared lock deadlocked. Now each firing locks the
    row first: no deadlock is retried.
    """
    # GRACE: a pass that comes late on a busy machine still fires its slot (docs/schedules.md).
    ticks = {f"tick{n}": {"EVERY": 1, "QUEUE": f"s-race{n}", "GRACE": 10} for n in range(3)}
    processes = [schedulers(ticks, "--max-runtime", 15) for _ in range(4)]
    retried = []
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, f"runqueueschedules exited {process.returncode}:\n{stderr[-4000:]}"
        retried += [match.group(1) for match in RETRIED.finditer(stderr)]
    deadlocks = [error for error in retried if "deadlock" in error.lower()]
    assert deadlocks == [], f"{len(deadlocks)} deadlock(s) retried: {deadlocks[:3]}"
    for n in range(3):
        slots = [m.headers["schedule_slot"] for m in Message.objects.filter(queue=f"s-race{n}")]
        counts = Counter(slots)
        assert max(counts.values()) == 1, [slot for slot, k in counts.items() if k > 1]  # exactly once per slot
        runs = list(ScheduleRun.objects.filter(schedule_id=f"tick{n}").order_by("slot"))
        assert [run.slot.isoformat() for run in runs] == sorted(slots)  # each message has its run row
        # None missing: one slot for every second from the first to the last.
        assert [b.slot - a.slot for a, b in itertools.pairwise(runs)] == [timedelta(seconds=1)] * (len(runs) - 1)
        assert len(runs) >= 12
