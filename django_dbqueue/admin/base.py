"""What the queue admins share: no edit forms, operators' permissions, escaped display, bounded actions.

Rows of the queue's tables change only through `django_dbqueue.control`
(one short transaction per row, nothing changed when its precondition
fails): the admins here read through querysets and write through those
controls, never by saving a form or updating a queryset.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Model, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext
from django.views.decorators.http import require_POST

from ..exceptions import DbQueueError
from ..models import ArchivedMessage, Message
from ..overview import format_progress, progress_percent
from ..paginator import EstimatingPaginator
from ..validation import storable_text

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin as ModelAdmin
else:

    class _ModelAdminOf:
        """``ModelAdmin[SomeModel]``: generic in its model for type checkers (django-stubs), plain at run time.

        Django's ModelAdmin takes no type arguments; this stands in for it as
        a base class, so the admins here are typed by the model they show.
        """

        def __getitem__(self, model: object) -> type[admin.ModelAdmin]:
            return admin.ModelAdmin

    ModelAdmin = _ModelAdminOf()

# The rows a queue admin shows: live or archived messages.
Row = TypeVar("Row", bound=Message | ArchivedMessage)
# Any admin's model.
M = TypeVar("M", bound=Model)
T = TypeVar("T")
R = TypeVar("R")

# What each operator's action needs, besides the model's view permission.
PERMISSIONS = {
    "cancel": "django_dbqueue.cancel_message",
    "replay": "django_dbqueue.replay_archivedmessage",
    "pause": "django_dbqueue.pause_queue",
    "purge": "django_dbqueue.delete_deadletter",
}

# How many rows one action handles per request; a selection "across all pages"
# of a large table would otherwise hold the request for minutes.
ACTION_LIMIT = 1000
# A search for payload text starts with this; anything else is an exact id or key.
PAYLOAD_PREFIX = "payload:"
# How many refusals (and ids left unchanged) one action lists before summing up.
REPORT_LIMIT = 10


def shown(text: str) -> str:
    """Text as a page shows it: NUL and lone surrogates visible as ``\\x00`` and ``\\ud800``.

    The API refuses both, but a plain SQL producer can store them (NUL on
    MariaDB and SQLite, a lone surrogate as a JSON escape on SQLite), and a
    lone surrogate cannot be encoded into a response at all.
    """
    return storable_text(text, limit=None)


def pretty_json(value: Any) -> SafeString:
    """JSON indented in a <pre>, escaped: a payload holding markup shows as text, any stored value renders."""
    return format_html('<pre class="dbqueue-json">{}</pre>', shown(json.dumps(value, indent=2, ensure_ascii=False)))


def progress_bar(progress: Any, *, cancel_requested: bool = False) -> SafeString | str:
    """A handler's progress report as a bar (indeterminate without a total) and its text; "-" when none."""
    text = format_progress(progress)
    if not text:
        return "-"
    percent = progress_percent(progress.get("done"), progress.get("total"))
    bar = (
        format_html('<progress max="100" value="{}"></progress>', percent)
        if percent is not None
        else mark_safe("<progress></progress>")  # a constant: indeterminate
    )
    flag = mark_safe(' <span class="dbqueue-badge stale">cancel requested</span>') if cancel_requested else ""
    return format_html('<span class="dbqueue-progress">{} {}{}</span>', bar, shown(text), flag)


def flat(fields: Sequence[str | Sequence[str]]) -> list[str]:
    """The field names of a ``fields`` layout (rows given as tuples)."""
    return [name for item in fields for name in ((item,) if isinstance(item, str) else item)]


def full_text(value: str) -> SafeString:
    return format_html('<pre class="dbqueue-error">{}</pre>', shown(value)) if value else SafeString("-")


def listed(items: list[str]) -> str:
    """``a, b, c`` or, past ``REPORT_LIMIT`` items, ``a, b, c and 7 more``."""
    limit = REPORT_LIMIT
    text = ", ".join(items[:limit])
    return text if len(items) <= limit else f"{text} and {len(items) - limit} more"


class NoEditForms:
    """Rows change only through queue operations: no add, edit or plain delete forms."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class OperatorPermissions:
    """``has_<name>_permission`` for the operators' actions (``@admin.action(permissions=[name])`` asks these)."""

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["cancel"])

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["replay"])

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["purge"])

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["pause"])


def posted_action(request: HttpRequest) -> str | None:
    """The list action a POST asks for, read as Django's ``response_action`` reads it (``index`` picks the form)."""
    try:
        index = int(request.POST.get("index", 0))
    except ValueError:
        index = 0
    names = request.POST.getlist("action")
    return names[index] if 0 <= index < len(names) else None


class RefusedActions(ModelAdmin[M], Generic[M]):
    """A list action the user may not run, POSTed anyway, is refused with 403 Forbidden.

    Django leaves such an action out of the list page, but answers a POST of
    it with the list again (200) or a redirect (302) and "No action
    selected": docs/operators.md promises 403, as the detail pages' buttons
    answer. The page offers only the actions the user may run, so any other
    name (one the user lacks permission for, or none of this list's) is refused.
    """

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if request.method == "POST":
            name = posted_action(request)
            if name and name not in self.get_actions(request):
                raise PermissionDenied
        return super().changelist_view(request, extra_context)


class ReadOnlyQueueAdmin(NoEditForms, OperatorPermissions, RefusedActions[Row], Generic[Row]):
    """Live and archived messages: estimated counts, escaped payloads, actions as POSTs."""

    paginator = EstimatingPaginator
    show_full_result_count = False  # a second COUNT(*) over the whole table on every filtered page
    list_per_page = 50
    # Searches an index serves: a number is an id, other text a key;
    # "payload:text" searches payloads, reading every row it considers.
    search_fields = ["=id", "=key"]
    id_fields: tuple[str, ...] = ("id",)
    search_help_text = "A number finds an id, other text an exact key; payload:text searches payloads (slow)."
    # A detail page's buttons: URL name -> the list action it runs on that one row.
    object_actions: dict[str, str] = {}
    action_limit = ACTION_LIMIT

    # Escaped, readable forms of the fields live and archived rows share.
    @admin.display(description="queue", ordering="queue")
    def queue_shown(self, obj: Message | ArchivedMessage) -> str:
        return shown(obj.queue)

    @admin.display(description="kind", ordering="kind")
    def kind_shown(self, obj: Message | ArchivedMessage) -> str:
        return shown(obj.kind)

    @admin.display(description="key", ordering="key")
    def key_shown(self, obj: Message | ArchivedMessage) -> str:
        return "-" if obj.key is None else shown(obj.key)

    @admin.display(description="payload")
    def payload_pretty(self, obj: Message | ArchivedMessage) -> SafeString:
        return pretty_json(obj.payload)

    @admin.display(description="headers")
    def headers_pretty(self, obj: Message | ArchivedMessage) -> SafeString:
        return pretty_json(obj.headers)

    @admin.display(description="progress")
    def progress_shown(self, obj: Message | ArchivedMessage) -> SafeString | str:
        return progress_bar(obj.progress, cancel_requested=getattr(obj, "cancel_requested_at", None) is not None)

    @admin.display(description="meta")
    def meta_pretty(self, obj: Message | ArchivedMessage) -> SafeString | str:
        return "-" if obj.meta is None else pretty_json(obj.meta)

    @admin.display(description="last error")
    def last_error_full(self, obj: Message | ArchivedMessage) -> SafeString:
        return full_text(obj.last_error)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Row], search_term: str
    ) -> tuple[QuerySet[Row], bool]:
        """One index-served lookup per search, never an OR with a payload scan."""
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.startswith(PAYLOAD_PREFIX):
            return queryset.filter(payload__icontains=term[len(PAYLOAD_PREFIX) :].strip()), False
        if term.isdigit():
            match = Q()
            for field in self.id_fields:
                match |= Q(**{field: int(term)})
            return queryset.filter(match), False
        return queryset.filter(key=term), False

    # --- a detail page's buttons: the list's actions on one row --------------------

    def object_action_urls(self) -> list[URLPattern]:
        """``<id>/do/<name>/``: one POST-only view for the buttons of a detail page."""
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/do/<str:name>/",
                self.admin_site.admin_view(require_POST(self.object_action)),
                name="{}_{}_do".format(*info),
            )
        ]

    def get_object_or_404(self, request: HttpRequest, object_id: str) -> Row:
        obj = self.get_object(request, object_id)  # None for a missing or malformed id
        if obj is None:
            raise Http404(f"no {self.opts.verbose_name} with id {object_id!r}")
        return obj

    def object_action(self, request: HttpRequest, object_id: str, name: str) -> HttpResponse:
        if name not in self.object_actions:
            raise Http404(f"no action {name!r}")
        action = getattr(self, self.object_actions[name])
        allowed = [getattr(self, f"has_{p}_permission")(request) for p in action.allowed_permissions]
        if not (self.has_view_permission(request) and all(allowed)):
            raise PermissionDenied
        obj = self.get_object_or_404(request, object_id)
        action(request, self.get_queryset(request).filter(pk=obj.pk))
        return HttpResponseRedirect(self.after_object_action(request, obj))

    def after_object_action(self, request: HttpRequest, obj: Row) -> str:
        if self.get_queryset(request).filter(pk=obj.pk).exists():
            return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[obj.pk])
        return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")

    def get_urls(self) -> list[URLPattern]:
        return self.object_action_urls() + super().get_urls()

    # --- actions on the selected rows ------------------------------------------------

    def selected(self, request: HttpRequest, queryset: QuerySet[Any, T]) -> list[T]:
        """The first ``action_limit`` selected rows, in the list's order; says so when more were selected."""
        rows = list(queryset[: self.action_limit + 1])
        if len(rows) > self.action_limit:
            rows = rows[: self.action_limit]
            self.message_user(
                request,
                f"Only the first {self.action_limit} selected rows were handled; "
                "narrow the list with its filters to reach the rest.",
                messages.WARNING,
            )
        return rows

    def apply(
        self, request: HttpRequest, queryset: QuerySet[Row], operation: Callable[[Row], R], done: str, skipped: str
    ) -> list[R]:
        """Run ``operation`` on each selected row (at most ``action_limit``); tell the user what happened.

        ``operation`` returns something falsy for a row it left unchanged (listed by id
        under ``skipped``) and raises `DbQueueError` to refuse one
        (its reason shown). Returns the other rows' results.
        """
        results: list[R] = []
        refused: list[str] = []
        unchanged: list[str] = []
        for row in self.selected(request, queryset):
            try:
                result = operation(row)
            except DbQueueError as exc:
                refused.append(str(exc))
                continue
            if not result:
                unchanged.append(str(row.pk))
            else:
                results.append(result)
        if results:
            self.message_user(request, f"{len(results)} {done}.", messages.SUCCESS)
        if unchanged:
            self.message_user(request, f"{skipped}: {listed(unchanged)}.", messages.WARNING)
        limit = REPORT_LIMIT
        for reason in refused[:limit]:
            self.message_user(request, f"Refused: {reason}", messages.ERROR)
        if len(refused) > limit:
            self.message_user(request, f"Refused {len(refused) - limit} more.", messages.ERROR)
        return results


@functools.cache
def breadcrumbs_are_a_list() -> bool:
    """Whether the running Django's admin marks breadcrumbs up as ``<ol><li>`` (6.0 on) or as a ``<div>`` (5.2).

    Read from the admin's own base template, so that pages here match
    the stock pages around them whatever the version.
    """
    stock = Path(admin.__file__).parent / "templates" / "admin" / "base.html"
    return '<ol class="breadcrumbs">' in stock.read_text(encoding="utf-8")


def breadcrumbs(opts: Any, *crumbs: tuple[str, str | None]) -> dict[str, Any]:
    """Context for ``admin/django_dbqueue/breadcrumbs.html``: Home, the app, then ``crumbs`` (label, url or None)."""
    app = reverse("admin:app_list", kwargs={"app_label": opts.app_label})
    trail = [(gettext("Home"), reverse("admin:index")), (str(opts.app_config.verbose_name), app), *crumbs]
    return {"dbqueue_breadcrumbs": trail, "dbqueue_breadcrumbs_are_a_list": breadcrumbs_are_a_list()}
