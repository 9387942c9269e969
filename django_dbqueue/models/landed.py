"""Whether a lease holder's change landed, read back from the database after a lost connection.

When the connection drops after a statement was sent (the reply of a
COMMIT that succeeded never arrives), the client cannot tell whether the
change was made. Retried blindly, a change guarded by the lease finds the
lease gone (its own first try took it) and would answer "lease lost" for
work that was done. So a message whose change may have landed unseen is
marked *unsure*; and when a later try of that change finds the lease gone,
the answer comes from what the database holds:

- an ack, a dead letter or a cancel: the archive row of this lease. The
  archive keeps the claim's time (``claimed_at``), which no other lease of
  the message shares: a later claim can only start after this lease ended,
  at a later time. With the finisher's name and the outcome, that row is
  this lease's finish and nobody else's (the reaper signs as ``reaper``).
  An operator's cancel of a message nobody runs is read back the same way
  (its claim time is the one the cancel read, or none).
- an ack on a queue with ``ARCHIVE`` off: it leaves no row, so only what
  the database holds of the message answers. Still live: the ack did not
  land (it deletes the row whole). Gone, with an archive row of any
  outcome: something else finished it (a cancel, the reaper's expiry, a
  dead letter), not this ack. Gone without a trace: this ack, or a delete
  outside the queue, or another lease's ack once this one had ended (none
  of them leaves a row): the answer is *unknown* (None), never an ack
  nobody can prove, nor a "lease lost" nobody can either.
- a retry, a requeue, a snooze, a release: the live row still carries
  this claim's time, no lease token, and the attempts and worker this
  change left (the reaper's give-back empties the worker but keeps the
  attempt; a snooze and a release give it back).
- a heartbeat's extension needs none: done twice, it is the same.

The mark lives on the message object, so it holds across every layer that
retries (the queue operation's own bounded retries, the worker's writer)
and is cleared once an answer is known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from django.db.models import Q

from ..conf import queue_options
from ..db.errors import DATABASE_TROUBLE, outcome_unknown
from .archive import ArchivedMessage, Outcome
from .protocols import LiveMessage

if TYPE_CHECKING:
    from django.db.models import QuerySet

T = TypeVar("T")
UNSURE = "_dbqueue_unsure"


def unsure(message: LiveMessage) -> bool:
    """Whether a change of this message may have landed without its answer reaching us."""
    return bool(message.__dict__.get(UNSURE))


def settled(messages: Iterable[LiveMessage]) -> None:
    for message in messages:
        message.__dict__.pop(UNSURE, None)


@contextmanager
def watching(using: str, messages: Iterable[LiveMessage]) -> Iterator[None]:
    """Mark ``messages`` unsure when the block fails in a way that may have done its work unseen."""
    try:
        yield
    except DATABASE_TROUBLE as exc:
        if outcome_unknown(exc, using):
            for message in messages:
                message.__dict__[UNSURE] = True
        raise


def guarded(using: str, message: LiveMessage, change: Callable[[], T], landed: Callable[[], T], miss: T) -> T:
    """One try of a lease-guarded ``change`` of ``message``; when it misses (returns ``miss``) after an
    unsure try, the answer is ``landed()``'s: what the database holds of that try's change."""
    with watching(using, [message]):
        done = change()
        if done == miss and unsure(message):
            done = landed()
    settled([message])
    return done


def finisher(message: LiveMessage, worker: str | None) -> str:
    """The ``finished_by`` an archive row of this lease's finish carries (as ``from_live`` writes it)."""
    return worker or message.claimed_by


def finished_row(using: str, message: LiveMessage, outcome: str, worker: str | None) -> ArchivedMessage | None:
    """The archive row of this lease's finish as ``outcome``, if it is there."""
    rows = ArchivedMessage.objects.using(using).filter(
        message_id=message.pk, outcome=outcome, claimed_at=message.claimed_at, finished_by=finisher(message, worker)
    )
    return rows.order_by("-id").first()


def finished(
    using: str, live: QuerySet[Any], messages: Sequence[LiveMessage], outcome: str, worker: str | None
) -> tuple[set[int], set[int]]:
    """Which of ``messages`` this lease finished as ``outcome``, and which it may have acked unseen
    (``ARCHIVE`` off, gone without a trace: unknown). ``live``: the live table."""
    if not messages:
        return set(), set()
    match = Q()
    for message in messages:
        match |= Q(message_id=message.pk, claimed_at=message.claimed_at, finished_by=finisher(message, worker))
    rows = ArchivedMessage.objects.using(using).filter(match, outcome=outcome)
    done = set(rows.values_list("message_id", flat=True))
    unarchived = [
        m.pk for m in messages if m.pk not in done and outcome == Outcome.ACKED and not queue_options(m.queue).archive
    ]
    if not unarchived:
        return done, set()
    # The live table first: a row gone from it stays gone (ids are never reused), and the archive
    # row of whatever removed it was written with that removal, so it is there by the next read.
    still = set(live.filter(pk__in=unarchived).values_list("pk", flat=True))
    gone = [pk for pk in unarchived if pk not in still]
    if not gone:
        return done, set()
    ended = ArchivedMessage.objects.using(using).filter(message_id__in=gone)  # a cancel, an expiry, a dead letter
    traced = set(ended.values_list("message_id", flat=True))
    return done, {pk for pk in gone if pk not in traced}


def changed(live: QuerySet[Any], message: LiveMessage, *, worker: str, attempts: int) -> bool:
    """Whether the live row shows this lease given up by its own change: no token, this claim's time,
    and the worker and attempts that change left."""
    return bool(
        live.filter(
            pk=message.pk,
            lease_token__isnull=True,
            claimed_at=message.claimed_at,
            claimed_by=worker,
            attempts=attempts,
        ).exists()
    )
