"""The workflows' admin through Django's test client: the list, the graph page, cancel and replay with and without
their permissions."""

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import django_dbqueue
from django_dbqueue import Step, Workflow
from django_dbqueue.admin import graphs
from django_dbqueue.models import ArchivedMessage, Message, Outcome, WorkflowRun
from tests.support.admin_helpers import changelist, post_action, staff, user_messages

pytestmark = pytest.mark.django_db

Q = "wf"
SCRIPT = "<script>alert('x')</script>"


def take(name: str, run: WorkflowRun | None = None) -> Message:
    """Claim the ready message of step ``name`` (of ``run``, if given), releasing the others claimed with it."""
    claimed = django_dbqueue.claim(Q, 100)
    mine = [
        m
        for m in claimed
        if m.headers["dbqueue_step"][1] == name and run in (None, WorkflowRun(pk=m.headers["dbqueue_step"][0]))
    ]
    for other in claimed:
        if other not in mine:
            other.release()
    assert len(mine) == 1
    return mine[0]


def diamond(name: str = "nightly") -> WorkflowRun:
    workflow = Workflow(name)
    workflow.add("a", Q, max_attempts=1)
    workflow.group(Step("b", Q), Step("c", Q), after=["a"])
    workflow.add("d", Q, after=["b", "c"])
    return workflow.enqueue()


def viewer(client, *extra):
    client.force_login(staff("ops", "view_workflowrun", *extra))
    return client


def page(client, run):
    response = client.get(reverse("admin:django_dbqueue_workflowrun_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode()


def states(run):
    return {s["name"]: s["state"] for s in Workflow.status(run.pk)["steps"]}


def test_the_list_needs_the_view_permission(client):
    client.force_login(staff("nobody"))
    assert client.get(changelist("workflowrun")).status_code == 403
    viewer(client)
    assert client.get(changelist("workflowrun")).status_code == 200


def test_the_list_filters_by_state_outcome_and_name_and_searches_by_name(client):
    running = diamond("nightly")
    failed = diamond("hourly")
    take("a", failed).fail("boom", retry=False)
    viewer(client)

    def listed(query):
        response = client.get(changelist("workflowrun") + query)
        assert response.status_code == 200
        return {row.pk for row in response.context["cl"].result_list}

    assert listed("") == {running.pk, failed.pk}
    assert listed("?state=finished") == {failed.pk}
    assert listed("?state=running") == {running.pk}
    assert listed("?outcome=failed") == {failed.pk}
    assert listed("?outcome=succeeded") == set()
    assert listed("?name=hourly") == {failed.pk}
    assert listed("?q=nightly") == {running.pk}
    assert listed("?q=night") == set()  # an exact name, by the index
    response = client.get(changelist("workflowrun"))
    assert "hourly" in response.content.decode()  # the name filter's choices


def test_the_page_draws_one_box_per_step_with_its_state(client):
    run = diamond()
    take("a").ack()
    html = page(viewer(client), run)
    svg = re.search(r"<svg[^>]*class=\"dbqueue-graph\".*?</svg>", html, re.S).group(0)
    boxes = dict(re.findall(r'data-step="([^"]+)"><rect[^>]*><title>[^<]*: (\w+)</title>', svg))
    assert boxes == {"a": "acked", "b": "enqueued", "c": "enqueued", "d": "waiting"}
    assert svg.count("<line") == 4  # a->b, a->c, b->d, c->d


def test_layers_follow_the_longest_path():
    nodes = [graphs.Node(n, "waiting") for n in "abcd"]
    layers = graphs.layers(nodes, [("a", "b"), ("b", "c"), ("a", "c"), ("c", "d")])
    assert [[n.name for n in layer] for layer in layers] == [["a"], ["b"], ["c"], ["d"]]


def test_a_large_graph_draws_its_first_layers_and_says_how_many_steps_are_left():
    nodes = [graphs.Node("root", "acked")] + [graphs.Node(f"s{n}", "waiting") for n in range(5)]
    nodes += [graphs.Node("join", "waiting")]
    edges = [("root", f"s{n}") for n in range(5)] + [(f"s{n}", "join") for n in range(5)]
    svg = graphs.workflow_svg(nodes, edges, limit=6)
    assert svg.count('class="dbqueue-step"') == 6
    assert "1 more step(s) not drawn: the first 2 of 3 layers" in svg
    wide = graphs.workflow_svg([graphs.Node(f"s{n}", "waiting") for n in range(10)], [], limit=4)
    assert wide.count('class="dbqueue-step"') == 4
    assert "6 more step(s) not drawn" in wide


def test_an_empty_graph_says_so():
    svg = graphs.workflow_svg([], [])
    assert "<svg" in svg and "No steps." in svg and 'class="dbqueue-step"' not in svg


def test_names_are_escaped(client):
    workflow = Workflow(SCRIPT)
    workflow.add("x", Q)
    run = workflow.enqueue()
    html = page(viewer(client), run)
    assert SCRIPT not in html
    assert "&lt;script&gt;" in html


def test_each_step_shows_its_state_reason_and_a_link_to_its_message_or_archive_row(client):
    run = diamond()
    first = take("a")
    first.fail("boom", retry=False)
    html = page(viewer(client, "view_archivedmessage", "view_message"), run)
    archive = f"{changelist('archivedmessage')}?message_id={first.pk}"
    assert f'href="{archive}"' in html
    assert "dependency &#x27;a&#x27; ended dead" in html
    assert 'class="dbqueue-step-dead">dead' in html
    assert html.count('class="dbqueue-step-cancelled">cancelled') == 3
    assert [row.message_id for row in client.get(archive).context["cl"].result_list] == [first.pk]

    second = diamond("other")
    step = Message.objects.get(headers__dbqueue_step=[second.pk, "a"])
    html = page(client, second)
    assert f'href="{reverse("admin:django_dbqueue_message_change", args=[step.pk])}"' in html
    assert 'class="dbqueue-step-waiting">waiting' in html
    assert client.get(reverse("admin:django_dbqueue_message_change", args=[step.pk])).status_code == 200


def test_cancel_needs_its_permission(client):
    run = diamond()
    viewer(client)
    response = client.post(changelist("workflowrun"), {"action": "cancel", "_selected_action": [run.pk], "index": 0})
    assert response.status_code == 403
    assert WorkflowRun.objects.get(pk=run.pk).state == "running"
    assert 'value="cancel"' not in client.get(changelist("workflowrun")).content.decode()  # not offered


def test_cancel_with_its_permission_cancels_the_workflow(client):
    run = diamond()
    viewer(client, "cancel_workflowrun")
    response = post_action(client, "workflowrun", "cancel", [run.pk])
    assert response.status_code == 200
    assert any("1 workflow(s) cancelled" in m for m in user_messages(response))
    assert states(run) == {"a": "cancelled", "b": "cancelled", "c": "cancelled", "d": "cancelled"}
    assert (WorkflowRun.objects.get(pk=run.pk).outcome, Message.objects.count()) == ("cancelled", 0)
    again = post_action(client, "workflowrun", "cancel", [run.pk])
    assert any("Finished already" in m for m in user_messages(again))


def test_replay_dead_steps_needs_the_replay_permission(client):
    run = diamond()
    take("a").fail("boom", retry=False)
    viewer(client, "cancel_workflowrun")
    response = client.post(
        changelist("workflowrun"), {"action": "replay_dead_steps", "_selected_action": [run.pk], "index": 0}
    )
    assert response.status_code == 403
    assert states(run)["a"] == "dead"


def test_replay_dead_steps_resumes_the_workflow(client):
    run = diamond()
    take("a").fail("boom", retry=False)
    viewer(client, "replay_archivedmessage")
    response = post_action(client, "workflowrun", "replay_dead_steps", [run.pk])
    assert any("1 dead step(s) replayed" in m for m in user_messages(response))
    assert states(run) == {"a": "enqueued", "b": "waiting", "c": "waiting", "d": "waiting"}
    assert WorkflowRun.objects.get(pk=run.pk).state == "running"
    assert ArchivedMessage.objects.get(outcome=Outcome.DEAD).replayed_at is not None
    again = post_action(client, "workflowrun", "replay_dead_steps", [run.pk])
    assert any("No dead steps" in m for m in user_messages(again))


def do(client, run, name):
    return client.post(reverse("admin:django_dbqueue_workflowrun_do", args=[run.pk, name]), follow=True)


def test_the_pages_buttons_need_their_permissions(client):
    run = diamond()
    take("a").fail("boom", retry=False)
    other = diamond("other")
    html = page(viewer(client), run)
    assert 'name="cancel"' not in html and 'name="replay-dead-steps"' not in html
    assert do(client, other, "cancel").status_code == 403
    assert do(client, run, "replay-dead-steps").status_code == 403
    assert do(client, run, "nonsense").status_code == 404
    assert client.get(reverse("admin:django_dbqueue_workflowrun_do", args=[run.pk, "cancel"])).status_code == 405
    assert (states(run)["a"], states(other)["a"]) == ("dead", "enqueued")


def test_the_pages_buttons_cancel_and_replay(client):
    run = diamond()
    take("a").fail("boom", retry=False)
    other = diamond("other")
    viewer(client, "cancel_workflowrun", "replay_archivedmessage")
    assert 'name="replay-dead-steps"' in page(client, run)
    assert 'name="cancel"' in page(client, other)
    response = do(client, run, "replay-dead-steps")
    assert response.redirect_chain[-1][0] == reverse("admin:django_dbqueue_workflowrun_change", args=[run.pk])
    assert states(run)["a"] == "enqueued"
    do(client, other, "cancel")
    assert WorkflowRun.objects.get(pk=other.pk).outcome == "cancelled"
    assert 'name="cancel"' not in page(client, other)  # finished: nothing to cancel


# --- at scale ---------------------------------------------------------------------------------


def test_the_search_takes_an_exact_name_compared_byte_for_byte(client):
    lower, upper = diamond("nightly"), diamond("Nightly")
    viewer(client)

    def found(term):
        response = client.get(changelist("workflowrun"), {"q": term})
        return {row.pk for row in response.context["cl"].result_list}

    assert (found("nightly"), found("Nightly"), found("nightl"), found(" nightly ")) == (
        {lower.pk},
        {upper.pk},
        set(),
        {lower.pk},
    )


def test_a_workflows_page_reads_its_steps_once_and_none_of_their_json(client):
    run = diamond()
    viewer(client)
    with CaptureQueriesContext(connection) as queries:
        page(client, run)
    steps = [q["sql"] for q in queries.captured_queries if "dbqueue_workflow_step" in q["sql"]]
    assert len(steps) == 1, steps
    assert "payload" not in steps[0] and "result" not in steps[0] and "options" not in steps[0]


@pytest.mark.django_db(transaction=True)
def test_the_admin_workflows_bench_phase_measures_every_page_and_removes_its_rows():
    from django_dbqueue.contrib.bench import adminpages

    kept = diamond("kept")
    measured = adminpages.measure("default", "bench.", Q, workflows=30, steps=120, rounds=1)
    assert [name for name, *_ in measured] == [
        "workflows list, whole table",
        "workflows list, state=running",
        "workflows list, search by exact name",
        "workflow page, 120 steps (baseline: 10 steps)",
    ]
    assert all(ours > 0 and baseline > 0 for _, ours, baseline, _ in measured)
    assert list(WorkflowRun.objects.values_list("pk", flat=True)) == [kept.pk]


def test_the_name_filters_choices_are_the_first_names_in_order_by_a_skip_scan():
    for name in ["b", "a", "B", "c", "a", "a "]:
        WorkflowRun.objects.create(name=name, created_at=timezone.now())
    assert WorkflowRun.objects.names(limit=3) == {"B", "a", "a "}  # compared byte for byte: "B" < "a" < "a " < "b"
    assert WorkflowRun.objects.names() == {"B", "a", "a ", "b", "c"}
