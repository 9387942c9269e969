"""The live table's states, and the queryset methods that read them.

The one definition of each state (ready, scheduled, in flight), of the
lease guard and of "attempts used up", which every other statement on the
live table reuses. The model is reached through ``self.model``: this module
sits below `messages` and never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Self, TypedDict

from django.db import models
from django.db.models import Case, Count, F, Min, Q, Value, When
from django.db.models.functions import Coalesce

from .. import validation
from ..db.clock import DbNow, db_now
from ..exceptions import NotClaimed
from .archive import ArchivedMessage
from .protocols import Live, LiveMessage
from .statements import MESSAGE_TABLE, distinct_leading


class MessageState(models.TextChoices):
    READY = "ready"
    SCHEDULED = "scheduled"
    IN_FLIGHT = "in_flight", "in flight"


class StateAnnotations(TypedDict):
    """What `MessageQuerySet.with_state` annotates: the row's state, and the database's time (for ages)."""

    current_state: str
    db_now: datetime


def state_filters() -> dict[MessageState, Q]:
    """The one definition of each live state, judged by the database's clock.

    ``ready`` is claimable now (including messages whose lease ran out),
    ``scheduled`` waits for its time, ``in_flight`` is leased to a worker.
    """
    now = DbNow()
    return {
        MessageState.READY: Q(available_at__lte=now),
        MessageState.SCHEDULED: Q(available_at__gt=now, lease_token__isnull=True),
        MessageState.IN_FLIGHT: Q(available_at__gt=now, lease_token__isnull=False),
    }


def lease_held(token: str, ids: Iterable[int]) -> Q:
    """The lease guard, the one definition: rows ``ids`` still carry ``token``, and the lease has not run out.

    A lease that ran out is lost even before another worker claims the
    message: the reaper or a new claim may act on it at any moment.
    """
    return Q(pk__in=list(ids), lease_token=token, available_at__gt=DbNow())


def held_token(message: LiveMessage) -> str:
    """The lease token of a claimed message; NotClaimed when it has none."""
    if message.pk is None or not message.lease_token:
        raise NotClaimed(f"message {message.pk} is not claimed (it has no lease token); claim it first")
    return message.lease_token


def exhausted(max_attempts: int) -> Q:
    """Leased, with no attempts left (``max_attempts``: the queue's default for messages that set none)."""
    return Q(lease_token__isnull=False, attempts__gte=Coalesce("max_attempts", Value(max_attempts)))


# QuerySet wants a Model for its rows, which a Protocol cannot say it is: `Live` is `Message` once bound.
class StateReads(models.QuerySet[Live]):  # type: ignore[type-var]
    """Querysets whose methods name the states of the lifecycle, and the reads built on them.

    Generic in the model (`Live`): `MessageQuerySet` binds it to `Message`.
    """

    def chosen_db(self) -> str | None:
        """The alias given to ``using()``, if any: without one, the queue's routing picks the database."""
        return self._db  # type: ignore[attr-defined,no-any-return]  # QuerySet._db is not in django-stubs

    def for_queue(self, queue: str | Iterable[str]) -> Self:
        return self.filter(queue=queue) if isinstance(queue, str) else self.filter(queue__in=list(queue))

    def ready(self) -> Self:
        return self.filter(state_filters()[MessageState.READY])

    def scheduled(self) -> Self:
        return self.filter(state_filters()[MessageState.SCHEDULED])

    def in_flight(self) -> Self:
        return self.filter(state_filters()[MessageState.IN_FLIGHT])

    def in_state(self, state: str) -> Self:
        return self.filter(state_filters()[MessageState(state)])

    def with_state(self) -> Self:
        """Annotate each row's state as ``current_state``, and the database's time as ``db_now`` (for ages)."""
        return self.annotate(
            db_now=DbNow(),
            current_state=Case(
                *(When(match, then=Value(state.value)) for state, match in state_filters().items()),
                output_field=models.CharField(),
            ),
        )

    def expired(self) -> Self:
        return self.filter(expires_at__lte=DbNow())

    def claimable(self, max_attempts: int) -> Self:
        """What a claim may take now: ready, not expired, and not a poison message.

        ``max_attempts`` is the queue's default, for messages that set none. A
        message whose lease expired on its last attempt killed (or outlived)
        its worker: the reaper dead-letters it, nobody claims it again.
        """
        not_expired = Q(expires_at__isnull=True) | Q(expires_at__gt=DbNow())
        return self.ready().filter(not_expired).exclude(exhausted(max_attempts))

    def queue_names(self) -> set[str]:
        """The queues that have live messages, read off the claim index (its first column), not the rows."""
        return set(distinct_leading(self.db, MESSAGE_TABLE, "queue"))

    def poison(self, max_attempts: int) -> Self:
        """Messages whose lease ran out on their last attempt: the reaper dead-letters them."""
        return self.ready().filter(exhausted(max_attempts))

    def counts_by_queue(self) -> dict[str, dict[str, int]]:
        """``{queue: {"ready": n, "scheduled": n, "in_flight": n}}`` in one query."""
        match = state_filters()
        rows = self.values("queue").annotate(
            ready=Count("id", filter=match[MessageState.READY]),
            scheduled=Count("id", filter=match[MessageState.SCHEDULED]),
            in_flight=Count("id", filter=match[MessageState.IN_FLIGHT]),
        )
        return {
            row["queue"]: {"ready": row["ready"], "scheduled": row["scheduled"], "in_flight": row["in_flight"]}
            for row in rows.order_by("queue")
        }

    def oldest_ready_age(self, queue: str | Iterable[str] | None = None) -> timedelta | None:
        """How long the oldest ready message has been waiting (None when none is)."""
        qs = self.ready() if queue is None else self.for_queue(queue).ready()
        oldest = qs.aggregate(oldest=Min("available_at"))["oldest"]
        return None if oldest is None else max(db_now(self.db) - oldest, timedelta(0))

    def held_by(self, workers: Iterable[str]) -> int:
        """How many messages ``workers`` (worker names) hold leases on now, read off the claimed_by index."""
        names = list(workers)
        return self.filter(claimed_by__in=names, lease_token__isnull=False).count() if names else 0

    def leased(self, message: LiveMessage) -> Self:
        """The queryset that matches ``message`` only while its holder's lease holds (`lease_held`)."""
        return self.filter(lease_held(held_token(message), [message.pk]))

    def give_back(self, *, count_attempt: bool) -> int:
        """Make these leased messages ready again, keeping their place in the queue.

        A message given back (a dead worker's, a shutdown's unstarted ones, an
        operator's release) becomes ready at the time it first became
        available, not at "now", so it does not wait behind the backlog that
        arrived after it. ``count_attempt=False`` (it never ran) gives the
        claim's attempt back too.
        """
        changes: dict[str, Any] = {"lease_token": None, "available_at": F("first_available_at"), "claimed_by": ""}
        if not count_attempt:
            changes["attempts"] = F("attempts") - 1
        return self.filter(lease_token__isnull=False).update(**changes)

    def take_first(self, queue: str) -> Live | None:
        """Remove and return the oldest message of a queue that only its one reader consumes (a reply queue)."""
        found = self.filter(queue=queue).order_by("id").first()
        if found is not None:
            self.filter(pk=found.pk)._raw_delete(self.db)
        return found

    def locate(self, pk: int, **match: Any) -> Live | ArchivedMessage | None:
        """The live message ``pk``, else its newest archive row, else None.

        A message keeps its id in the archive as ``message_id``; ``match``
        narrows both lookups (a queue, a kind).
        """
        validation.message_id(pk)
        live = self.filter(pk=pk, **match).first()
        if live is not None:
            return live
        return ArchivedMessage.objects.using(self.db).filter(message_id=pk, **match).order_by("-id").first()
