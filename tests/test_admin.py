"""The operators' admin through Django's test client: every view and action, with and without permissions."""

from datetime import timedelta

import pytest
from django.contrib.admin.utils import display_for_value
from django.test import Client
from django.urls import reverse
from django.utils import timezone

import django_dbqueue
from django_dbqueue.admin import MessageAdmin
from django_dbqueue.admin import base as admin_base
from django_dbqueue.models import ArchivedMessage, Message, Outcome, QueueState
from tests.support.admin_helpers import changelist, post_action, staff, user_messages
from tests.support.factories import ArchivedMessageFactory, MessageFactory, WorkerFactory

pytestmark = pytest.mark.django_db

SCRIPT = "<script>alert('x')</script>"
VIEWS = {
    "message": "view_message",
    "archivedmessage": "view_archivedmessage",
    "deadletter": "view_deadletter",
    "queuestate": "view_queuestate",
}


@pytest.fixture
def viewer(client):
    client.force_login(staff("viewer", *VIEWS.values()))
    return client


def operator(client, *extra):
    client.force_login(staff("ops", *VIEWS.values(), *extra))
    return client


def change_url(model, pk):
    return reverse(f"admin:django_dbqueue_{model}_change", args=[pk])


def do_url(model, pk, name):
    return reverse(f"admin:django_dbqueue_{model}_do", args=[pk, name])


# --- seeing --------------------------------------------------------------------------


@pytest.mark.parametrize("model", VIEWS)
def test_lists_need_the_view_permission(client, model):
    assert client.get(changelist(model)).status_code == 302  # to the login page
    client.force_login(staff("nobody"))
    assert client.get(changelist(model)).status_code == 403
    client.force_login(staff("viewer", VIEWS[model]))
    assert client.get(changelist(model)).status_code == 200


def test_detail_pages_need_the_view_permission(client):
    message = MessageFactory()
    dead = ArchivedMessageFactory(dead=True)
    client.force_login(staff("nobody"))
    assert client.get(change_url("message", message.pk)).status_code == 403
    assert client.get(change_url("deadletter", dead.pk)).status_code == 403
    client.force_login(staff("viewer", "view_message", "view_deadletter"))
    assert client.get(change_url("message", message.pk)).status_code == 200
    assert client.get(change_url("deadletter", dead.pk)).status_code == 200


def test_message_list_shows_state_attempts_and_age(viewer):
    ready = MessageFactory(queue="mail", kind="welcome", key="k-ready", attempts=2)
    scheduled = MessageFactory(queue="mail", scheduled=True)
    MessageFactory(queue="other")
    [in_flight] = Message.objects.claim(["other"])
    response = viewer.get(changelist("message"))
    rows = {row.pk: row for row in response.context["cl"].result_list}
    assert {rows[ready.pk].current_state, rows[scheduled.pk].current_state, rows[in_flight.pk].current_state} == {
        "ready",
        "scheduled",
        "in_flight",
    }
    html = response.content.decode()
    assert "in flight" in html and "k-ready" in html and "welcome" in html
    age = response.context["cl"].model_admin.age(rows[ready.pk])
    assert age.endswith("s")  # created a second ago by the database's clock


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=ready", {"ready"}),
        ("state=scheduled", {"scheduled"}),
        ("state=in_flight", {"in-flight"}),
        ("queue=other", {"in-flight"}),
        ("kind=welcome", {"ready"}),
        ("available_at__gte=2000-01-01+00:00:00%2B00:00&available_at__lt=2000-01-02+00:00:00%2B00:00", set()),
        ("created_at__gte=2000-01-01+00:00:00%2B00:00", {"ready", "scheduled", "in-flight"}),
    ],
)
def test_message_list_filters(viewer, query, expected):
    MessageFactory(queue="mail", kind="welcome", key="ready")
    MessageFactory(queue="mail", key="scheduled", scheduled=True)
    MessageFactory(queue="other", key="in-flight")
    Message.objects.claim(["other"])
    response = viewer.get(f"{changelist('message')}?{query}")
    assert {row.key for row in response.context["cl"].result_list} == expected


def test_message_search_by_id_key_and_payload_text(viewer):
    first = MessageFactory(key="order-17", payload={"email": "ada@example.com"})
    second = MessageFactory(key="order-18", payload={"email": "bob@example.com"})

    def found(term):
        response = viewer.get(changelist("message"), {"q": term})
        return {row.pk for row in response.context["cl"].result_list}

    assert found(str(second.pk)) == {second.pk}
    assert found("order-17") == {first.pk}
    assert found("ADA@example") == set()  # plain text is an exact key: an index lookup, never a scan
    assert found("payload:ADA@example") == {first.pk}  # payload text only when asked for
    assert found("nowhere") == set()


def test_archive_list_filters_by_outcome_date_queue_and_searches(viewer):
    old = ArchivedMessageFactory(
        queue="mail", key="old", message_id=987_654, finished_at=timezone.now() - timedelta(days=40)
    )
    dead = ArchivedMessageFactory(queue="mail", key="dead", dead=True, payload={"sku": "XJ-9"})
    other = ArchivedMessageFactory(queue="other", key="other")

    def keys(query):
        response = viewer.get(f"{changelist('archivedmessage')}?{query}")
        return {row.key for row in response.context["cl"].result_list}

    assert keys("") == {"old", "dead", "other"}
    assert keys("outcome=dead") == {"dead"}
    assert keys("queue=other") == {"other"}
    since = (timezone.now() - timedelta(days=7)).replace(microsecond=0).isoformat().replace("+", "%2B")
    assert keys(f"finished_at__gte={since}") == {"dead", "other"}
    assert keys("q=payload:xj-9") == {"dead"}
    assert keys("q=xj-9") == set()
    assert keys(f"q={old.message_id}") == {"old"}
    assert other.pk and dead.pk


def test_dead_letters_list_only_dead_rows(viewer):
    ArchivedMessageFactory(key="acked")
    ArchivedMessageFactory(key="dead", dead=True)
    ArchivedMessageFactory(key="cancelled", outcome=Outcome.CANCELLED)
    response = viewer.get(changelist("deadletter"))
    assert {row.key for row in response.context["cl"].result_list} == {"dead"}
    assert "ValueError: boom" in response.content.decode()  # the error's last line


def test_dead_letter_detail_pretty_prints_and_escapes(viewer):
    dead = ArchivedMessageFactory(
        dead=True,
        payload={"note": SCRIPT, "items": [1, 2]},
        headers={"trace": "abc"},
        last_error=f"Traceback (most recent call last):\n  File x\nValueError: {SCRIPT}",
    )
    html = viewer.get(change_url("deadletter", dead.pk)).content.decode()
    assert SCRIPT not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "&quot;items&quot;: [\n    1,\n    2\n  ]" in html  # indented JSON
    assert "&quot;trace&quot;: &quot;abc&quot;" in html
    assert "Traceback (most recent call last):\n  File x\nValueError: &lt;script&gt;" in html  # the whole error
    # A viewer without the replay or purge permission gets no buttons.
    assert 'name="replay"' not in html and 'name="purge"' not in html


def test_payload_markup_is_escaped_in_lists(viewer):
    MessageFactory(key=SCRIPT)
    ArchivedMessageFactory(dead=True, key=SCRIPT, last_error=SCRIPT)
    for model in ("message", "deadletter", "archivedmessage"):
        html = viewer.get(changelist(model)).content.decode()
        assert SCRIPT not in html and "&lt;script&gt;" in html


# --- live messages' actions ---------------------------------------------------------


def test_live_actions_need_the_cancel_permission(viewer):
    message = MessageFactory(scheduled=True)
    assert viewer.get(changelist("message")).context["action_form"] is None  # no action offered
    for action in ("cancel", "run_now", "release_lease", "delete_selected"):  # POSTed anyway: refused
        assert post_action(viewer, "message", action, [message.pk]).status_code == 403
    for name in ("run-now", "cancel", "release"):
        assert viewer.post(do_url("message", message.pk, name)).status_code == 403
    assert 'name="cancel"' not in viewer.get(change_url("message", message.pk)).content.decode()
    assert Message.objects.scheduled().filter(pk=message.pk).exists()


def test_run_now_cancel_and_release_actions(client):
    client = operator(client, "cancel_message")
    scheduled = MessageFactory(queue="q", scheduled=True)
    response = post_action(client, "message", "run_now", [scheduled.pk])
    assert Message.objects.ready().filter(pk=scheduled.pk).exists()
    assert "1 made ready now." in user_messages(response)
    [claimed] = Message.objects.claim("q")
    response = post_action(client, "message", "run_now", [claimed.pk])
    assert "In flight, left alone: " + str(claimed.pk) + "." in user_messages(response)
    response = post_action(client, "message", "release_lease", [claimed.pk])
    assert "1 released." in user_messages(response)
    assert Message.objects.get(pk=claimed.pk).lease_token is None
    response = post_action(client, "message", "cancel", [claimed.pk])
    assert "1 cancelled." in user_messages(response)
    row = ArchivedMessage.objects.get(message_id=claimed.pk)
    assert row.outcome == Outcome.CANCELLED and row.finished_by == "ops"


def test_cancel_of_a_running_message_flags_it_and_says_its_worker_stops_it(client):
    client = operator(client, "cancel_message")
    django_dbqueue.enqueue("q", {})
    [running] = Message.objects.claim("q")
    response = post_action(client, "message", "cancel", [running.pk])
    said = user_messages(response)
    assert "1 cancelled." in said and any("1 of them running: cancel requested" in m for m in said)
    assert Message.objects.get().cancel_requested_at is not None and not ArchivedMessage.objects.exists()
    html = client.get(change_url("message", running.pk)).content.decode()
    assert "cancel requested" not in html  # no progress reported: no bar, the flag shows as its time
    assert display_for_value(Message.objects.get().cancel_requested_at, "-") in html


def test_message_and_archive_pages_show_progress_and_meta(viewer):
    django_dbqueue.enqueue("q", {})
    [running] = Message.objects.claim("q")
    Message.objects.filter(pk=running.pk).update(
        progress={"done": 3, "total": 12, "note": SCRIPT}, meta={"table": "orders"}
    )
    html = viewer.get(change_url("message", running.pk)).content.decode()
    assert '<progress max="100" value="25"></progress>' in html and "3 of 12 (25%)" in html
    assert SCRIPT not in html and "&lt;script&gt;" in html  # the note is escaped
    assert "&quot;table&quot;: &quot;orders&quot;" in html
    running.refresh_from_db()
    assert running.ack()
    row = ArchivedMessage.objects.get()
    assert row.progress["done"] == 3 and row.meta == {"table": "orders"}
    html = viewer.get(change_url("archivedmessage", row.pk)).content.decode()
    assert "3 of 12 (25%)" in html and "&quot;table&quot;: &quot;orders&quot;" in html


def test_an_action_handles_at_most_its_limit_of_rows_and_says_so(client, monkeypatch):
    monkeypatch.setattr(MessageAdmin, "action_limit", 2)
    client = operator(client, "cancel_message")
    first, _, _ = (MessageFactory(queue="q", scheduled=True) for _ in range(3))
    response = post_action(client, "message", "run_now", [first.pk], select_across=1)  # "select all 3"
    assert "2 made ready now." in user_messages(response)
    assert any(m.startswith("Only the first 2 selected rows were handled") for m in user_messages(response))
    assert Message.objects.ready().count() == 2
    # The list's order: newest first.
    assert list(Message.objects.scheduled().values_list("pk", flat=True)) == [first.pk]


def test_refusals_are_listed_up_to_a_limit(client, monkeypatch):
    monkeypatch.setattr(admin_base, "REPORT_LIMIT", 2)
    client = operator(client, "replay_archivedmessage")
    acked = [ArchivedMessageFactory() for _ in range(5)]
    response = post_action(client, "archivedmessage", "replay", [row.pk for row in acked])
    refusals = [m for m in user_messages(response) if m.startswith("Refused")]
    assert len(refusals) == 3 and refusals[-1] == "Refused 3 more."
    assert not Message.objects.exists()


def test_detail_buttons_post_the_same_actions(client):
    client = operator(client, "cancel_message")
    message = MessageFactory(queue="q", scheduled=True)
    html = client.get(change_url("message", message.pk)).content.decode()
    assert 'name="run-now"' in html and 'name="cancel"' in html and 'name="release"' in html
    assert client.get(do_url("message", message.pk, "run-now")).status_code == 405  # only POST changes things
    response = client.post(do_url("message", message.pk, "run-now"))
    assert response.status_code == 302 and response.url == change_url("message", message.pk)
    assert Message.objects.ready().filter(pk=message.pk).exists()
    assert client.post(do_url("message", message.pk, "explode")).status_code == 404
    assert client.post(do_url("message", "not-a-number", "run-now")).status_code == 404
    assert client.post(do_url("message", 10**12, "run-now")).status_code == 404
    response = client.post(do_url("message", message.pk, "cancel"))
    assert response.url == changelist("message")  # gone from the live table
    assert ArchivedMessage.objects.cancelled().filter(message_id=message.pk).exists()


def test_actions_are_refused_without_a_csrf_token():
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff("ops", *VIEWS.values(), "cancel_message", "replay_archivedmessage", "pause_queue"))
    message = MessageFactory(scheduled=True)
    dead = ArchivedMessageFactory(dead=True)
    assert client.post(do_url("message", message.pk, "run-now")).status_code == 403
    assert client.post(do_url("deadletter", dead.pk, "replay")).status_code == 403
    pause = reverse("admin:django_dbqueue_queuestate_pause")
    assert client.post(pause, {"queue": "q", "paused": "1"}).status_code == 403
    assert Message.objects.scheduled().count() == 1 and not QueueState.objects.exists()
    assert ArchivedMessage.objects.get().replayed_at is None


# --- dead letters: replay, edit and replay, purge --------------------------------------


def test_replay_needs_view_and_replay_permissions(viewer, client):
    dead = ArchivedMessageFactory(dead=True)
    client.force_login(staff("blind", "replay_archivedmessage"))
    assert client.post(do_url("deadletter", dead.pk, "replay")).status_code == 403
    edit = reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=[dead.pk])
    assert client.get(edit).status_code == 403
    client.force_login(staff("ops", "view_deadletter", "replay_archivedmessage"))
    assert client.get(reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=["nope"])).status_code == 404
    assert not Message.objects.exists()


def test_replay_needs_its_permission(viewer):
    dead = ArchivedMessageFactory(dead=True)
    assert viewer.get(changelist("deadletter")).context["action_form"] is None
    assert post_action(viewer, "deadletter", "replay", [dead.pk]).status_code == 403
    assert viewer.post(do_url("deadletter", dead.pk, "replay")).status_code == 403
    edit = reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=[dead.pk])
    assert viewer.get(edit).status_code == 403
    assert viewer.post(edit, {"payload": "{}"}).status_code == 403
    assert not Message.objects.exists()


def test_a_list_action_without_its_permission_is_403_beside_actions_the_user_may_run(client):
    """Django answered 302 ("No action selected") when the user had other actions; docs/operators.md says 403."""
    dead = ArchivedMessageFactory(dead=True)
    client.force_login(staff("replayer", "view_deadletter", "replay_archivedmessage"))
    offered = dict(client.get(changelist("deadletter")).context["action_form"].fields["action"].choices)
    assert "replay" in offered and "purge" not in offered
    assert post_action(client, "deadletter", "purge", [dead.pk]).status_code == 403
    assert post_action(client, "deadletter", "delete_selected", [dead.pk]).status_code == 403
    assert post_action(client, "deadletter", "no_such_action", [dead.pk]).status_code == 403
    assert ArchivedMessage.objects.filter(pk=dead.pk).exists()
    # The empty choice is not an action: the list says so, as Django does.
    response = post_action(client, "deadletter", "", [dead.pk])
    assert response.status_code == 200 and "No action selected." in user_messages(response)


def test_replay_records_who_and_links_the_new_message(client):
    client = operator(client, "replay_archivedmessage")
    # A message_id no live message has: the factory's sequence could equal the replay's new id.
    dead = ArchivedMessageFactory(
        dead=True, queue="mail", kind="welcome", payload={"to": "ada"}, attempts=5, message_id=10**12
    )
    response = post_action(client, "deadletter", "replay", [dead.pk])
    new = Message.objects.get()
    assert (new.queue, new.kind, new.payload, new.replay_of) == ("mail", "welcome", {"to": "ada"}, dead.pk)
    assert new.attempts == 0
    assert Message.objects.ready().filter(pk=new.pk).exists()
    assert "1 replayed." in user_messages(response)
    dead.refresh_from_db()
    assert dead.replayed_by == "ops" and dead.replayed_as == new.pk and dead.replayed_at is not None
    html = client.get(change_url("deadletter", dead.pk)).content.decode()
    follow = reverse("admin:django_dbqueue_deadletter_follow", args=[new.pk])
    assert f'href="{follow}"' in html
    assert client.get(follow).url == change_url("message", new.pk)
    # Once it is finished, the link leads to its archive row.
    [claimed] = Message.objects.claim("mail")
    claimed.ack()
    assert client.get(follow).url == f"{changelist('archivedmessage')}?message_id={new.pk}"
    archived = client.get(client.get(follow).url).context["cl"].result_list
    assert [row.outcome for row in archived] == [Outcome.ACKED]


def test_second_replay_is_refused_unless_forced(client):
    client = operator(client, "replay_archivedmessage")
    dead = ArchivedMessageFactory(dead=True)
    client.post(do_url("deadletter", dead.pk, "replay"))
    response = client.post(do_url("deadletter", dead.pk, "replay"), follow=True)
    assert any(m.startswith("Refused: ") and "force" in m for m in user_messages(response))
    assert Message.objects.count() == 1
    html = client.get(change_url("deadletter", dead.pk)).content.decode()
    assert 'name="replay-forced"' in html and 'name="replay"' not in html
    response = client.post(do_url("deadletter", dead.pk, "replay-forced"), follow=True)
    assert "1 replayed." in user_messages(response)
    assert Message.objects.count() == 2


def test_replay_from_the_archive_refuses_acked_rows(client):
    client = operator(client, "replay_archivedmessage")
    acked = ArchivedMessageFactory()
    response = post_action(client, "archivedmessage", "replay", [acked.pk])
    assert any("acked" in m for m in user_messages(response))
    assert not Message.objects.exists()


def test_edit_and_replay_validates_the_json(client):
    client = operator(client, "replay_archivedmessage")
    dead = ArchivedMessageFactory(dead=True, payload={"qty": "three", "note": SCRIPT})
    url = reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=[dead.pk])
    html = client.get(url).content.decode()
    assert "&quot;qty&quot;: &quot;three&quot;" in html and SCRIPT not in html
    response = client.post(url, {"payload": '{"qty": three}'})
    assert response.status_code == 200
    assert "The payload is not valid JSON: Expecting value at line 1, column 9." in response.content.decode()
    assert not Message.objects.exists()
    response = client.post(url, {"payload": '{"qty": 3}'})
    assert response.status_code == 302
    assert Message.objects.get().payload == {"qty": 3}
    dead.refresh_from_db()
    assert dead.payload == {"qty": "three", "note": SCRIPT} and dead.replayed_by == "ops"
    # Again: refused unless "force" is ticked.
    response = client.post(url, {"payload": '{"qty": 4}'})
    assert response.status_code == 200 and "force=True replays it again" in response.content.decode()
    assert client.post(url, {"payload": '{"qty": 4}', "force": "on"}).status_code == 302
    assert sorted(m.payload["qty"] for m in Message.objects.all()) == [3, 4]


def test_the_replays_confirmation_links_a_page_that_works_once_the_message_is_acked(client):
    """The link led to the live message's page, a 404 once a worker acked it: it follows the message now."""
    client = operator(client, "replay_archivedmessage")
    dead = ArchivedMessageFactory(dead=True, queue="mail", payload={"to": "ada"})
    url = reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=[dead.pk])
    response = client.post(url, {"payload": '{"to": "ada@example.com"}'}, follow=True)
    new = Message.objects.get()
    follow = reverse("admin:django_dbqueue_deadletter_follow", args=[new.pk])
    assert user_messages(response) == [f'Replayed as message <a href="{follow}">{new.pk}</a>.']
    [claimed] = Message.objects.claim("mail")
    claimed.ack()
    response = client.get(follow, follow=True)
    assert response.status_code == 200
    assert [row.message_id for row in response.context["cl"].result_list] == [new.pk]
    # The list action's confirmation, likewise.
    again = ArchivedMessageFactory(dead=True, queue="mail")
    response = post_action(client, "deadletter", "replay", [again.pk])
    newer = Message.objects.get()
    follow = reverse("admin:django_dbqueue_deadletter_follow", args=[newer.pk])
    assert f'New message: <a href="{follow}">{newer.pk}</a>.' in user_messages(response)


def test_purge_needs_its_permission_and_deletes_only_dead_letters(client):
    dead = ArchivedMessageFactory(dead=True)
    operator(client, "replay_archivedmessage")
    assert client.post(do_url("deadletter", dead.pk, "purge")).status_code == 403
    client.force_login(staff("purger", "view_deadletter", "delete_deadletter"))
    html = client.get(change_url("deadletter", dead.pk)).content.decode()
    assert 'name="purge"' in html
    also_dead = ArchivedMessageFactory(dead=True)
    kept = ArchivedMessageFactory(dead=True)
    response = post_action(client, "deadletter", "purge", [dead.pk, also_dead.pk])
    assert "2 dead letter(s) purged." in user_messages(response)
    assert list(ArchivedMessage.objects.values_list("pk", flat=True)) == [kept.pk]
    response = client.post(do_url("deadletter", kept.pk, "purge"))
    assert response.url == changelist("deadletter") and not ArchivedMessage.objects.exists()


# --- the overview ------------------------------------------------------------------------


def test_overview_is_linked_from_the_app_index(viewer):
    html = viewer.get(reverse("admin:app_list", args=["django_dbqueue"])).content.decode()
    assert f'href="{changelist("queuestate")}"' in html and ">Queues<" in html


def test_overview_shows_counts_chart_and_workers(viewer):
    MessageFactory(queue="mail", created_at=timezone.now() - timedelta(minutes=10))
    MessageFactory(queue="mail", scheduled=True)
    ArchivedMessageFactory(queue="mail", dead=True, finished_at=timezone.now())
    ArchivedMessageFactory(queue="mail", finished_at=timezone.now())
    WorkerFactory(name="alive-worker")
    WorkerFactory(name="silent-worker", stale=True)
    response = viewer.get(changelist("queuestate"))
    assert response.status_code == 200
    mail = next(row["queue"] for row in response.context["rows"] if row["queue"].name == "mail")
    assert (mail.ready, mail.scheduled, mail.in_flight, mail.dead) == (1, 1, 0, 1)
    assert sum(mail.acked_per_hour) == 1 and sum(mail.dead_per_hour) == 1
    html = response.content.decode()
    assert "<svg" in html and "acked (1)" in html and "dead (1)" in html
    assert "10m" in html  # the oldest ready message's age
    assert "http" not in html.split("<svg", 1)[1].split("</svg>", 1)[0].replace("http://www.w3.org/2000/svg", "")
    workers = {row["worker"].name: row["worker"].stale for row in response.context["workers"]}
    assert workers == {"alive-worker": False, "silent-worker": True}
    assert html.count('class="dbqueue-badge stale"') == 1
    assert 'name="paused"' not in html  # no pause buttons without the permission


def test_overview_lists_each_pool_with_its_children_under_it(viewer):
    from django_dbqueue.models import Worker

    state = {"processes": 2, "target": 2, "min": 1, "max": 4, "grown": 1, "decision": "grew to 2: the next ..."}
    Worker.objects.register("pool-a", ["mail"], 1, pool=state)
    Worker.objects.register("pool-a-child", ["mail"], 1, supervisor="pool-a")
    Worker.objects.register("alone", ["mail"], 1)
    response = viewer.get(changelist("queuestate"))
    assert [row["worker"].name for row in response.context["workers"]] == ["alone", "pool-a", "pool-a-child"]
    html = response.content.decode()
    assert "pool of 2 processes (target 2, 1 to 4), 1 grown; last decision: grew to 2: the next ..." in html
    assert html.count("pool-child") == 1 and "↳ pool-a-child" in html


def test_pause_and_resume_need_their_permission(client):
    pause = reverse("admin:django_dbqueue_queuestate_pause")
    operator(client)
    assert client.post(pause, {"queue": "mail", "paused": "1"}).status_code == 403
    assert not QueueState.objects.exists()
    operator_client = Client()
    operator_client.force_login(staff("pauser", "view_queuestate", "pause_queue"))
    MessageFactory(queue="mail")
    assert 'name="paused" value="1"' in operator_client.get(changelist("queuestate")).content.decode()
    assert operator_client.get(pause).status_code == 405
    response = operator_client.post(pause, {"queue": "mail", "paused": "1"}, follow=True)
    assert "Queue mail paused." in user_messages(response)
    assert QueueState.objects.paused_names() == {"mail"}
    assert QueueState.objects.get().changed_by == "pauser"
    assert 'class="dbqueue-badge paused"' in response.content.decode()
    response = operator_client.post(pause, {"queue": "mail", "paused": "0"}, follow=True)
    assert "Queue mail resumed." in user_messages(response)
    assert QueueState.objects.paused_names() == set()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"queue": "bad name!", "paused": "1"}, "Not changed: queue name"),
        ({"queue": "mail", "paused": "maybe"}, "Select a valid choice"),
        ({"paused": "1"}, "This field is required"),
    ],
)
def test_pause_refuses_bad_input_with_a_reason(client, data, words):
    client.force_login(staff("pauser", "view_queuestate", "pause_queue"))
    response = client.post(reverse("admin:django_dbqueue_queuestate_pause"), data, follow=True)
    [message] = user_messages(response)
    assert message.startswith("Not changed") and words in message
    assert not QueueState.objects.exists()


def test_enqueued_messages_show_in_the_admin(viewer):
    message = django_dbqueue.enqueue("mail", {"to": "ada"}, kind="welcome")
    html = viewer.get(change_url("message", message.pk)).content.decode()
    assert "&quot;to&quot;: &quot;ada&quot;" in html and "welcome" in html


# --- rows a plain SQL producer stored ---------------------------------------------------

# What a plain SQL producer (docs/table-layout.md) can store although the API
# refuses it, and which databases store it: (JSON for payload, headers and
# result; text for queue, kind, key and last error; what the page shows).
ODD_VALUES = {
    "lone surrogate in JSON": ('{"note": "\\ud800"}', None, "\\ud800", {"sqlite"}),
    "NUL in JSON": ('{"note": "a\\u0000b"}', None, "a\\u0000b", {"sqlite", "mysql"}),
    "NUL in text": (None, "a\x00b", "a\\x00b", {"sqlite", "mysql"}),
}


def store_odd_values(json_text, text, rows):
    from django.db import connection

    with connection.cursor() as cursor:
        for table, pk in rows:
            if json_text is not None:
                columns = ["payload", "headers"] + (["result"] if table == "dbqueue_archive" else [])
                values = [json_text] * len(columns)
            else:
                columns = ["queue", "kind", connection.ops.quote_name("key"), "last_error"]
                values = [text] * len(columns)
            assignments = ", ".join(f"{column} = %s" for column in columns)
            cursor.execute(f"UPDATE {table} SET {assignments} WHERE id = %s", [*values, pk])


@pytest.mark.parametrize("case", ODD_VALUES)
def test_rows_a_plain_sql_producer_stored_render_escaped(client, case):
    """A lone surrogate stored on SQLite used to break the detail pages with a 500 (it cannot be encoded)."""
    from django.db import DatabaseError, connection, transaction

    json_text, text, shown, stored_by = ODD_VALUES[case]
    client.force_login(staff("ops", *VIEWS.values(), "replay_archivedmessage"))
    message, dead = MessageFactory(), ArchivedMessageFactory(dead=True)
    rows = [("dbqueue_message", message.pk), ("dbqueue_archive", dead.pk)]
    if connection.vendor not in stored_by:
        with pytest.raises(DatabaseError), transaction.atomic():
            store_odd_values(json_text, text, rows)
        pytest.skip(f"{connection.vendor} refuses a {case}")
    store_odd_values(json_text, text, rows)
    pages = [
        changelist("message"),
        change_url("message", message.pk),
        changelist("archivedmessage"),
        change_url("archivedmessage", dead.pk),
        changelist("deadletter"),
        change_url("deadletter", dead.pk),
        reverse("admin:django_dbqueue_deadletter_edit_and_replay", args=[dead.pk]),
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        assert "\x00" not in page, url
        if url not in (changelist("message"), changelist("archivedmessage"), changelist("deadletter")) or text:
            assert shown in page, url  # the detail pages and the edit form show every value; lists show the text
