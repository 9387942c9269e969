"""The queue admins' list filters: values from small sources only, states by the database's clock."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from django.contrib import admin
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from .. import handlers
from ..conf import get_settings
from ..models import Message, MessageQuerySet, MessageState
from .base import shown

M = TypeVar("M", bound=Model)


class ValuesFilter(admin.SimpleListFilter):
    """Choices from small sources (settings, handlers, an index): never a scan of a queue table.

    Any value in the URL filters, listed or not (a queue that exists only in
    the archive is reached by ``?queue=name``).
    """

    field = ""

    def known_values(self) -> set[str]:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = self.known_values()
        if chosen := self.value():
            values.add(chosen)
        return [(value, shown(value) or "(none)") for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[M]) -> QuerySet[M]:
        return queryset if self.value() is None else queryset.filter(**{self.field: self.value()})


class QueueFilter(ValuesFilter):
    title = parameter_name = field = "queue"

    def known_values(self) -> set[str]:
        configured = set(get_settings().queues) | {queue for queue, _ in handlers.registered()}
        return configured | Message.objects.queue_names()


class KindFilter(ValuesFilter):
    title = parameter_name = field = "kind"

    def known_values(self) -> set[str]:
        return {kind for _, kind in handlers.registered() if kind}


class StateFilter(admin.SimpleListFilter):
    """Ready, scheduled or in flight: the model layer's one definition of each state."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return list(MessageState.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet[Message]) -> QuerySet[Message]:
        state = self.value()
        if state is None or state not in MessageState.values:
            return queryset
        # The message admin's queryset, from Message's default manager: a MessageQuerySet.
        return cast(MessageQuerySet, queryset).in_state(state)
