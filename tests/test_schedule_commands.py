"""``runqueueschedules --once`` and the schedules in ``queuestats``."""

import json
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from django_dbqueue.models import Message

pytestmark = pytest.mark.django_db


def run(*args):
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_once_makes_one_pass_and_says_what_it_did(schedules):
    schedules("tick", every=1, queue="s-tick")
    first = run("runqueueschedules", "--once")
    assert "nothing due" in first, first  # first sight: nothing before counts
    time.sleep(1.1)
    output = run("runqueueschedules", "--once")
    messages = list(Message.objects.filter(queue="s-tick"))
    assert 1 <= len(messages) <= 2, output  # the slots of the 1.1 seconds between the passes
    for message in messages:
        # On time, or (when the pass came more than the 1 s grace late) the newest missed slot, caught up.
        said = f"tick: slot {message.headers['schedule_slot']} ({message.headers['schedule_trigger']}) sent message"
        assert f"{said} {message.pk}" in output, output
        assert message.headers["schedule_trigger"] in ("scheduled", "catch-up"), output
    assert "next slot at " in output


def test_a_bad_declaration_stops_the_command(schedules):
    schedules("broken", cron="0 0 * * FUNDAY", queue="s-tick")
    with pytest.raises(CommandError, match=r"schedule 'broken'.*bad day-of-week field 'FUNDAY'"):
        run("runqueueschedules", "--once")


def test_queuestats_lists_the_schedules(schedules):
    schedules("tick", every=3600, queue="s-tick")
    run("runqueueschedules", "--once")
    text = run("queuestats")
    assert "Schedules (1)" in text
    assert "tick  every 1h  -> s-tick  next " in text and "no run yet  ENABLED" in text
    [entry] = json.loads(run("queuestats", "--json"))["schedules"]
    assert (entry["name"], entry["state"], entry["timing"]) == ("tick", "enabled", "every 1h")
    assert entry["next_slot"].endswith(":00:00+00:00") and entry["last_outcome"] == ""


def test_queuestats_aligns_the_schedules_columns(schedules):
    schedules("tick", every=3600, queue="s-tick")
    schedules("a-much-longer-name", every=7200, queue="s-tick-longer")
    run("runqueueschedules", "--once")
    text = run("queuestats")
    lines = text[text.index("Schedules (2)") :].splitlines()[1:3]
    assert [line.split()[0] for line in lines] == ["a-much-longer-name", "tick"]
    for column in ("every", "-> ", "next ", "ENABLED"):
        assert len({line.index(column) for line in lines}) == 1, (column, lines)


def test_queuestats_says_its_figures_cover_24_hours():
    header = run("queuestats").splitlines()[0]
    assert "acked and dead over the last 24 hours" in header and "per hour" not in header
