"""The queues' overview (django_dbqueue.overview), its chart, and ``manage.py queuestats``."""

import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

import django_dbqueue
from django_dbqueue.admin.charts import Series, hourly_bars
from django_dbqueue.control import set_paused
from django_dbqueue.models import Message, Outcome, QueueStat
from django_dbqueue.overview import HOURS, as_table, build_overview, format_age
from tests.support.admin_helpers import staff
from tests.support.factories import ArchivedMessageFactory, MessageFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def hour_of(moment):
    return moment.replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def busy():
    """Queue "mail": two ready (the oldest 10 minutes), one scheduled, one in flight; history; a paused queue."""
    now = timezone.now()
    MessageFactory(queue="mail", created_at=now - timedelta(minutes=10))
    MessageFactory(queue="mail")
    MessageFactory(queue="mail", scheduled=True)
    MessageFactory(queue="mail", priority=-1)
    [claimed] = Message.objects.claim("mail")
    finished = {
        "acked-now": (Outcome.ACKED, now - timedelta(minutes=1)),
        "acked-3h": (Outcome.ACKED, now - timedelta(hours=3)),
        "dead-3h": (Outcome.DEAD, now - timedelta(hours=3, minutes=1)),
        "acked-2d": (Outcome.ACKED, now - timedelta(days=2)),  # outside the 24 hours
        "expired": (Outcome.EXPIRED, now - timedelta(minutes=2)),  # neither acked nor dead
    }
    for key, (outcome, at) in finished.items():
        ArchivedMessageFactory(queue="mail", key=key, outcome=outcome, finished_at=at)
    ArchivedMessageFactory(queue="old", dead=True, finished_at=now - timedelta(days=3))
    set_paused("held", True)
    WorkerFactory(name="alive", queues=["mail"])
    WorkerFactory(name="silent", stale=True)
    return {"claimed": claimed, "finished": finished}


def test_counts_ages_and_workers(busy):
    overview = build_overview()
    queues = {q.name: q for q in overview.queues}
    mail = queues["mail"]
    assert (mail.ready, mail.scheduled, mail.in_flight, mail.dead, mail.paused) == (2, 1, 1, 1, False)
    assert timedelta(minutes=9) < mail.oldest_ready_age < timedelta(minutes=12)
    assert queues["old"].dead == 1 and queues["old"].oldest_ready_age is None
    assert queues["held"].paused
    # Declared queues show even when empty; a queue on another database does not.
    assert {"short", "no-archive", "w-ok"} <= set(queues) and "elsewhere" not in queues
    assert [w.name for w in overview.workers] == ["alive", "silent"]
    assert [w.stale for w in overview.workers] == [False, True]
    assert overview.workers[1].silent_for > timedelta(minutes=4)


def test_acked_and_dead_per_hour_from_the_archive(busy):
    overview = build_overview()
    assert overview.per_hour_source == "archive"
    assert len(overview.hours) == HOURS and overview.hours[-1] == hour_of(overview.now)
    mail = next(q for q in overview.queues if q.name == "mail")
    expected_acked, expected_dead = [0] * HOURS, [0] * HOURS
    for key in ("acked-now", "acked-3h"):
        expected_acked[overview.hours.index(hour_of(busy["finished"][key][1]))] += 1
    expected_dead[overview.hours.index(hour_of(busy["finished"]["dead-3h"][1]))] += 1
    assert (mail.acked_per_hour, mail.dead_per_hour) == (expected_acked, expected_dead)


def test_per_hour_prefers_the_hourly_analytics(busy):
    hour = hour_of(timezone.now()) - timedelta(hours=5)
    QueueStat.objects.create(hour=hour, queue="mail", kind="a", acked=40, dead=2)
    QueueStat.objects.create(hour=hour, queue="mail", kind="b", acked=7, dead=1)
    QueueStat.objects.create(hour=hour - timedelta(days=2), queue="mail", acked=999)  # too old
    overview = build_overview()
    assert overview.per_hour_source == "hourly analytics"
    mail = next(q for q in overview.queues if q.name == "mail")
    slot = overview.hours.index(hour)
    assert mail.acked_per_hour[slot] == 47 and mail.dead_per_hour[slot] == 3
    assert sum(mail.acked_per_hour) == 47 and sum(mail.dead_per_hour) == 3


def test_as_json_is_plain_json(busy):
    data = json.loads(json.dumps(build_overview().as_json()))
    mail = next(q for q in data["queues"] if q["name"] == "mail")
    assert 540 < mail["oldest_ready_age"] < 720  # seconds
    assert len(mail["acked_per_hour"]) == HOURS
    assert data["workers"][1]["stale"] is True and isinstance(data["workers"][1]["last_heartbeat_at"], str)


def test_queuestats_prints_the_same_overview(busy):
    out = StringIO()
    call_command("queuestats", stdout=out)
    text = out.getvalue()
    [mail_line] = [line for line in text.splitlines() if line.startswith("mail ")]
    # queue, ready, scheduled, in flight, dead, oldest ready (two words), acked/24h, dead/24h
    assert re.fullmatch(r"mail\s+2\s+1\s+1\s+1\s+1\dm \d+s\s+2\s+1", mail_line), mail_line
    assert re.search(r"^held\s.*paused$", text, re.MULTILINE)
    assert "silent  queues default" in text and text.rstrip().endswith("STALE")
    assert text.count("STALE") == 1


def test_queuestats_json(busy):
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    data = json.loads(out.getvalue())
    mail = next(q for q in data["queues"] if q["name"] == "mail")
    assert (mail["ready"], mail["scheduled"], mail["in_flight"], mail["dead"]) == (2, 1, 1, 1)
    assert sum(mail["acked_per_hour"]) == 2 and data["per_hour_source"] == "archive"


def test_queuestats_refuses_an_unknown_database():
    with pytest.raises(CommandError, match="--database 'nope' is not in DATABASES"):
        call_command("queuestats", "--database", "nope")


def test_queuestats_with_no_queues(settings):
    settings.DBQUEUE = {}
    from django_dbqueue import handlers

    saved = handlers.registered()
    for queue, kind in saved:
        handlers.unregister(queue, kind)
    try:
        out = StringIO()
        call_command("queuestats", stdout=out)
    finally:
        for (queue, kind), function in saved.items():
            handlers.handler(queue, kind)(function)
    assert "no queues yet" in out.getvalue() and "Workers (0)" in out.getvalue()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (12, "12s"), (250, "4m 10s"), (7500, "2h 5m"), (3 * 86400 + 4 * 3600 + 5, "3d 4h")],
)
def test_format_age(seconds, text):
    assert format_age(None if seconds is None else timedelta(seconds=seconds)) == text


def test_chart_bars_scale_and_labels_are_escaped():
    hours = [hour_of(timezone.now()) - timedelta(hours=n) for n in (2, 1, 0)]
    svg = str(
        hourly_bars(hours, [Series("acked", "#0a0", [0, 5, 10]), Series("dead", "#a00", [1, 0, 0])], title="<b>x</b>")
    )
    heights = [float(h) for h in re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="[\d.]+" height="([\d.]+)"', svg)]
    assert heights[:6] == [0.0, 5.4, 27.0, 0.0, 54.0, 0.0]  # grouped by hour; the biggest fills the plot (54px)
    assert "&lt;b&gt;x&lt;/b&gt;" in svg and "<b>" not in svg
    assert f"{hours[2]:%H}:00 UTC: 10 acked" in svg and "acked (15)" in svg
    empty = str(hourly_bars(hours, [Series("acked", "#0a0", [0, 0, 0])]))
    assert "nan" not in empty.lower() and 'height="0.0"' in empty


def test_running_messages_with_progress_show_in_the_overview_and_its_page(client):
    django_dbqueue.enqueue("q", {}, kind="import")
    django_dbqueue.enqueue("q", {})
    first, quiet = Message.objects.claim("q", 2)
    Message.objects.filter(pk=first.pk).update(progress={"done": 40, "total": 80, "note": "rows"})
    django_dbqueue.cancel(first)
    overview = build_overview()
    [running] = overview.running  # only messages that reported progress
    assert (running.id, running.kind, running.percent, running.cancel_requested) == (first.pk, "import", 50, True)
    assert f"#{first.pk} q/import  40 of 80 (50%), rows" in as_table(overview)
    assert "CANCEL REQUESTED" in as_table(overview)
    client.force_login(staff("viewer", "view_queuestate"))
    html = client.get(reverse("admin:django_dbqueue_queuestate_changelist")).content.decode()
    assert 'id="running"' in html and '<progress max="100" value="50"></progress>' in html
    assert f'data-message="{first.pk}"' in html and f'data-message="{quiet.pk}"' not in html


def test_flow_controlled_queues_show_their_groups_in_flight_and_the_rate_used(client):
    for n in range(3):
        django_dbqueue.enqueue("fc-groups", {"n": n}, group="customer-1")
    django_dbqueue.enqueue("fc-groups", {}, group="customer-2")
    assert len(Message.objects.claim("fc-groups", 10)) == 3  # two of customer-1, one of customer-2
    django_dbqueue.enqueue_many("fc-rate-slow", [{}, {}])
    assert len(Message.objects.claim("fc-rate-slow", 10)) == 2
    overview = build_overview()
    by_queue = {f.queue: f for f in overview.flow}
    groups = by_queue["fc-groups"].groups
    assert [(g.name, g.in_flight, g.limit) for g in groups] == [("customer-1", 2, 2), ("customer-2", 1, 2)]
    assert by_queue["fc-groups"].rules == "2 per group; 1 per group of kind solo"
    assert (by_queue["fc-rate-slow"].rate_used, by_queue["fc-rate-slow"].rate_limit) == (2, "3/m")
    assert by_queue["fc-fifo"].rules == "ordered: one at a time per group" and by_queue["fc-fifo"].groups == []
    text = as_table(overview)
    assert "fc-groups: 2 per group; 1 per group of kind solo" in text
    assert (
        "group customer-1: 2 of 2 in flight" in text
        and "fc-rate-slow: rate 3/m (2 claim(s) in the current period)" in text
    )
    client.force_login(staff("viewer", "view_queuestate"))
    html = client.get(reverse("admin:django_dbqueue_queuestate_changelist")).content.decode()
    assert 'id="flow"' in html and 'data-group="customer-1">customer-1: 2 of 2</span>' in html
    assert "2 claim(s) of 3/m" in html
