"""The workflows' admin pages at scale, for queuebench's ``admin_workflows`` phase (docs/workflows.md).

Each page is rendered by the registered `WorkflowRunAdmin` itself (its
view, filters, search, paginator and template), for a superuser, and timed
to the end of its rendering; each against a baseline in the same run:
the list with Django's own paginator (a COUNT of the table), the search
with Django's ``=name`` lookup (``iexact``), a large workflow's page
against a small one's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.messages.storage.fallback import FallbackStorage
from django.core.paginator import Paginator
from django.http import HttpRequest
from django.test import RequestFactory
from django.utils import timezone

from ...models import WorkflowEdge, WorkflowRun, WorkflowStep
from ...workflows import Workflow

# One line of what the phase measured: name, ours (ms), baseline (ms), extras.
Measured = tuple[str, float, float, dict[str, Any]]
LAYER = 100  # steps per layer of the large workflow
NAMES = 500  # distinct workflow names among the list's rows


def measure(using: str, prefix: str, queue: str, workflows: int, steps: int, rounds: int = 7) -> list[Measured]:
    """Fill ``workflows`` workflow rows and one workflow of ``steps`` steps, time the pages, remove the rows."""
    try:
        big, small = _fill(using, prefix, queue, workflows, steps)
        model_admin: Any = admin.site._registry[WorkflowRun]
        changelist = partial(_render, model_admin.changelist_view)
        page = partial(_render, model_admin.change_view)
        rows = {"workflows": workflows, "rounds": rounds}
        name = f"{prefix}wf-7"
        with _swapped(model_admin, "paginator", Paginator):
            whole_django = _median(rounds, lambda: changelist({}))
            running_django = _median(rounds, lambda: changelist({"state": "running"}))
        with _swapped(model_admin, "get_search_results", partial(admin.ModelAdmin.get_search_results, model_admin)):
            search_django = _median(rounds, lambda: changelist({"q": name}))
        return [
            ("workflows list, whole table", _median(rounds, lambda: changelist({})), whole_django, rows),
            (
                "workflows list, state=running",
                _median(rounds, lambda: changelist({"state": "running"})),
                running_django,
                rows,
            ),
            (
                "workflows list, search by exact name",
                _median(rounds, lambda: changelist({"q": name})),
                search_django,
                rows,
            ),
            (
                f"workflow page, {steps:,} steps (baseline: 10 steps)",
                _median(rounds, lambda: page({}, object_id=str(big))),
                _median(rounds, lambda: page({}, object_id=str(small))),
                {"steps": steps, "rounds": rounds},
            ),
        ]
    finally:
        remove(using, prefix)


def remove(using: str, prefix: str) -> None:
    """Delete the phase's workflows (named ``prefix...``) with their steps and edges."""
    ids = list(WorkflowRun.objects.using(using).filter(name__startswith=prefix).values_list("pk", flat=True))
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        WorkflowEdge.objects.using(using).filter(workflow_id__in=chunk)._raw_delete(using)
        WorkflowStep.objects.using(using).filter(workflow_id__in=chunk)._raw_delete(using)
        WorkflowRun.objects.using(using).filter(pk__in=chunk)._raw_delete(using)


def _fill(using: str, prefix: str, queue: str, workflows: int, steps: int) -> tuple[int, int]:
    """The list's rows (one in ten running, ``NAMES`` names), and a layered workflow of ``steps`` and one of 10."""
    now = timezone.now()
    rows = [
        WorkflowRun(
            name=f"{prefix}wf-{n % NAMES}",
            state=WorkflowRun.RUNNING if n % 10 == 0 else WorkflowRun.FINISHED,
            outcome="" if n % 10 == 0 else "succeeded",
            open_steps=3 if n % 10 == 0 else 0,
            created_at=now,
            finished_at=None if n % 10 == 0 else now,
        )
        for n in range(workflows)
    ]
    WorkflowRun.objects.using(using).bulk_create(rows, batch_size=1000)
    return _layered(using, prefix + "big", queue, steps), _layered(using, prefix + "small", queue, 10)


def _layered(using: str, name: str, queue: str, steps: int) -> int:
    """A workflow of layers of ``LAYER`` steps, each step after the step above it; returns its id."""
    workflow = Workflow(name)
    for n in range(steps):
        layer, place = divmod(n, LAYER)
        workflow.add(f"s{layer}-{place}", queue, {}, after=[f"s{layer - 1}-{place}"] if layer else [])
    return workflow.enqueue(using=using).pk


def _render(view: Callable[..., Any], query: dict[str, str], **kwargs: Any) -> None:
    request = RequestFactory().get("/", query)
    request.user = get_user_model()(is_active=True, is_staff=True, is_superuser=True)
    _with_messages(request)
    response = view(request, **kwargs)
    response.render()
    assert response.status_code == 200, response.status_code


def _with_messages(request: HttpRequest) -> None:
    request.session = {}  # type: ignore[assignment]  # what the messages' fallback storage needs of a session
    request._messages = FallbackStorage(request)  # type: ignore[attr-defined]  # as MessageMiddleware sets it


def _median(rounds: int, action: Callable[[], None]) -> float:
    action()  # warm: templates compiled, statements prepared
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


@contextmanager
def _swapped(target: Any, name: str, value: Any) -> Iterator[None]:
    """``target.name`` is ``value`` inside the block (an instance attribute over the class's)."""
    setattr(target, name, value)
    try:
        yield
    finally:
        delattr(target, name)
