"""The operators' admin for schedules: the list at a glance, enable/disable, run now, orphans.

Every action is a POST through the admin's CSRF-protected action form and
needs its own permission: ``toggle_schedule`` (enable, disable),
``run_schedule`` (run now), ``delete_schedule`` (delete orphaned
schedules with their history; declared ones stay). Seeing needs ``view_schedule``. Rows are never
edited in a form: the declaration in code or settings is the truth, and the
switches go through the model layer's methods.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..exceptions import DbQueueError
from ..models import Schedule
from ..schedules.scheduler import run_now
from ..schedules.status import ScheduleStatus, schedule_statuses
from .base import RefusedActions

# The attribute a list page hangs each row's status on, for its display methods.
STATUS = "schedule_status"
PERMISSIONS = {"toggle": "django_dbqueue.toggle_schedule", "run": "django_dbqueue.run_schedule"}


@admin.register(Schedule)
class ScheduleAdmin(RefusedActions[Schedule]):
    """Schedules: timing, next slot, last run and where its message is now, and the switches."""

    list_display = ["name", "state", "timing_text", "next_run", "last_run", "queue", "kind"]
    list_filter = ["enabled", "queue"]
    search_fields = ["name", "queue", "kind"]
    actions = ["enable", "disable", "run_now"]
    fields = [
        ("name", "state", "timing_text"),
        ("queue", "kind", "origin"),
        ("next_run", "last_run"),
        ("created_at", "covered_until"),
        ("changed_at", "changed_by"),
    ]
    readonly_fields = [name for row in fields for name in row]

    # --- what each row shows ---------------------------------------------------------

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """Read the statuses of the page's rows in one go (a few queries), and hang each on its row."""
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)
        using = rows[0]._state.db if rows else None
        statuses = {status.name: status for status in schedule_statuses(using, rows=rows)}
        for row in rows:
            vars(row)[STATUS] = statuses[row.name]
        return changelist

    def _status(self, obj: Schedule) -> ScheduleStatus:
        status: ScheduleStatus | None = vars(obj).get(STATUS)
        if status is None:  # a detail page, an action: one row
            status = vars(obj)[STATUS] = schedule_statuses(obj._state.db or "default", rows=[obj])[0]
        return status

    @admin.display(description="state", ordering="enabled")
    def state(self, obj: Schedule) -> SafeString:
        status = self._status(obj)
        if status.orphaned:
            return format_html('<span title="{}">orphaned: never fires</span>', "No code or setting declares it now.")
        return format_html("{}", status.state)

    @admin.display(description="timing")
    def timing_text(self, obj: Schedule) -> str:
        return self._status(obj).timing

    @admin.display(description="next run")
    def next_run(self, obj: Schedule) -> str:
        slot = self._status(obj).next_slot
        return f"{slot:%Y-%m-%d %H:%M:%S} UTC" if slot is not None else "-"

    @admin.display(description="last run")
    def last_run(self, obj: Schedule) -> SafeString | str:
        status = self._status(obj)
        if status.last_slot is None:
            return "-"
        when = f"{status.last_slot:%Y-%m-%d %H:%M:%S} UTC ({status.last_trigger})"
        if status.last_message_id is None:
            return format_html("{}: skipped, its previous message was still live", when)
        url = reverse("admin:django_dbqueue_deadletter_follow", args=[status.last_message_id])
        message = status.last_message_id
        return format_html('{}: <a href="{}">message {}</a>, {}', when, url, message, status.last_outcome)

    # --- permissions -------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        """Only orphaned schedules may be deleted (a declared one would come back at the next pass)."""
        if obj is not None and not self._status(obj).orphaned:
            return False
        return super().has_delete_permission(request, obj)

    def has_toggle_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["toggle"])

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["run"])

    # --- actions -------------------------------------------------------------------------

    def _switch(self, request: HttpRequest, queryset: QuerySet[Schedule], enabled: bool) -> None:
        by = request.user.get_username()
        names = [row.name for row in queryset if Schedule.objects.using(queryset.db).set_enabled(row.name, enabled, by)]
        if names:
            what = "enabled" if enabled else "disabled"
            self.message_user(request, f"{len(names)} schedule(s) {what}: {', '.join(names)}.", messages.SUCCESS)

    @admin.action(description="Enable selected schedules (from now on, without catching up)", permissions=["toggle"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, True)

    @admin.action(description="Disable selected schedules", permissions=["toggle"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._switch(request, queryset, False)

    @admin.action(description="Run selected schedules now (one message each, off their slots)", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        by = request.user.get_username()
        for row in queryset:
            try:
                fired = run_now(row.name, using=queryset.db, by=by)
            except DbQueueError as exc:
                self.message_user(request, f"Refused: {exc}", messages.ERROR)
                continue
            if fired is None or fired.message is None:
                self.message_user(request, f"{row.name}: not sent, try again.", messages.WARNING)
                continue
            # Where the message is when clicked: live, or archived once a worker took it.
            url = reverse("admin:django_dbqueue_deadletter_follow", args=[fired.message.pk])
            self.message_user(
                request, format_html('{}: sent <a href="{}">message {}</a>.', row.name, url, fired.message.pk)
            )

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        """The delete action removes orphaned schedules only (a declared one would come back at the next pass)."""
        orphaned = [row.name for row in queryset if self._status(row).orphaned]
        kept = [row.name for row in queryset if row.name not in orphaned]
        queryset.filter(name__in=orphaned).delete()
        if kept:
            self.message_user(request, f"Still declared, kept: {', '.join(kept)}.", messages.WARNING)
