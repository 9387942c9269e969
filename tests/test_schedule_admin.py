"""The schedules' admin through the test client: the list, enable/disable and run now, with and without permission."""

import pytest
from django.urls import reverse

from django_dbqueue.models import Message, Schedule, ScheduleRun
from django_dbqueue.schedules.scheduler import Scheduler
from tests.support.admin_helpers import changelist, post_action, staff, user_messages
from tests.support.schedules import Clock, at

pytestmark = pytest.mark.django_db

VIEW = "view_schedule"


@pytest.fixture
def known(schedules):
    """A declared schedule that fired once (its message is still live), and an orphaned one."""
    schedules("nightly", cron="30 2 * * *", timezone="Europe/Berlin", queue="s-night", kind="report")
    schedules("gone", every=60, queue="s-gone")
    clock = Clock(at(2026, 5, 1, 0, 0))
    scheduler = Scheduler(clock=clock)
    scheduler.run_once()
    clock.advance(1820)  # just past 02:30 Berlin (00:30 UTC)
    scheduler.run_once()
    from django_dbqueue.schedules import registry

    registry.forget("gone")
    return Message.objects.get(queue="s-night")


def login(client, *codenames):
    client.force_login(staff("ops", *codenames))
    return client


def test_the_list_needs_the_view_permission(client, known):
    assert client.get(changelist("schedule")).status_code == 302
    login(client)
    assert client.get(changelist("schedule")).status_code == 403
    client.force_login(staff("viewer", VIEW))
    assert client.get(changelist("schedule")).status_code == 200


def test_the_list_shows_next_run_last_run_with_its_message_and_orphans(client, known):
    html = login(client, VIEW).get(changelist("schedule")).content.decode()
    assert "cron 30 2 * * * (Europe/Berlin)" in html
    assert "2026-05-01 00:30:00 UTC (scheduled)" in html  # the last run's slot
    follow = f"/admin/django_dbqueue/deadletter/follow/{known.pk}/"
    assert f'<a href="{follow}">message {known.pk}</a>, ready' in html  # its message, and where it is now
    assert "orphaned: never fires" in html
    nightly_row = html.split('schedule/nightly/change/">nightly</a>')[1].split("</tr>")[0]
    assert 'field-next_run">20' in nightly_row  # a declared, enabled schedule has a next run


def test_enable_and_disable_need_their_permission(client, known):
    response = post_action(login(client, VIEW), "schedule", "disable", ["nightly"])
    assert response.status_code == 403 and Schedule.objects.get(pk="nightly").enabled
    client.force_login(staff("switcher", VIEW, "toggle_schedule"))
    response = post_action(client, "schedule", "disable", ["nightly"])
    assert not Schedule.objects.get(pk="nightly").enabled
    assert "1 schedule(s) disabled: nightly." in user_messages(response)
    assert Schedule.objects.get(pk="nightly").changed_by == "switcher"
    assert ">disabled<" in client.get(changelist("schedule")).content.decode().replace("</td>", "<")
    post_action(client, "schedule", "enable", ["nightly"])
    assert Schedule.objects.get(pk="nightly").enabled


def test_run_now_needs_its_permission_and_sends_one_message(client, known):
    response = post_action(login(client, VIEW, "toggle_schedule"), "schedule", "run_now", ["nightly"])
    assert response.status_code == 403  # beside actions the user may run (Django answered 302)
    assert Message.objects.filter(queue="s-night").count() == 1
    client.force_login(staff("runner", VIEW, "run_schedule"))
    response = post_action(client, "schedule", "run_now", ["nightly"])
    manual = Message.objects.filter(queue="s-night", headers__schedule_trigger="manual").get()
    # The link follows the message (live, or archived once a worker took it): the live page would 404 then.
    follow = reverse("admin:django_dbqueue_deadletter_follow", args=[manual.pk])
    assert f'nightly: sent <a href="{follow}">message {manual.pk}</a>.' in [
        str(m) for m in response.context["messages"]
    ]
    assert ScheduleRun.objects.get(message_id=manual.pk).fired_by == "runner"
    client.force_login(staff("reader", "view_deadletter", "view_message", "view_archivedmessage"))
    assert client.get(follow)["Location"] == reverse("admin:django_dbqueue_message_change", args=[manual.pk])
    for claimed in Message.objects.claim("s-night", limit=10):
        assert claimed.ack()
    assert client.get(follow)["Location"].endswith(f"?message_id={manual.pk}")


def test_run_now_refuses_an_orphan(client, known):
    client.force_login(staff("runner", VIEW, "run_schedule"))
    before = Message.objects.filter(queue="s-gone").count()
    response = post_action(client, "schedule", "run_now", ["gone"])
    assert any("Refused: schedule 'gone' is not declared" in m for m in user_messages(response))
    assert Message.objects.filter(queue="s-gone").count() == before


def test_only_orphans_are_deleted_and_only_with_the_permission(client, known):
    post_action(login(client, VIEW), "schedule", "delete_selected", ["gone", "nightly"], post="yes")
    assert Schedule.objects.count() == 2
    client.force_login(staff("cleaner", VIEW, "delete_schedule"))
    post_action(client, "schedule", "delete_selected", ["nightly"], post="yes")  # declared: refused
    assert Schedule.objects.count() == 2
    post_action(client, "schedule", "delete_selected", ["gone"], post="yes")
    assert list(Schedule.objects.values_list("name", flat=True)) == ["nightly"]
    assert not ScheduleRun.objects.filter(schedule_id="gone").exists()  # its history went with it


def test_the_detail_page_is_read_only(client, known):
    client.force_login(staff("viewer", VIEW))
    response = client.get(f"/admin/django_dbqueue/schedule/{'nightly'}/change/")
    assert response.status_code == 200
    assert "covered" in response.content.decode().lower()
    assert client.post("/admin/django_dbqueue/schedule/nightly/change/", {}).status_code == 403
