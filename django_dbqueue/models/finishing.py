"""Finishing: a message leaves the live table for the archive, in the transaction that says how it ended.

One message (`Finishing.finish`, guarded by its lease, its token, its id or
its idleness), a batch of acknowledgements (`ack_many`), or the reaper's
expired messages. A try whose reply was lost is answered from the archive
(`landed`). The model is reached through ``self``: this module sits below
`messages` and never imports it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from django.db.models import Q

from .. import signals, validation
from ..conf import queue_options
from ..db import cursors
from ..db.clock import DbNow
from ..db.errors import with_retries
from ..db.transactions import short_transaction, write_transaction
from . import events, landed, workflows
from .archive import ArchivedMessage, Outcome
from .leasing import Leasing
from .protocols import Live, LiveMessage
from .statements import (
    ack_in_one_statement,
    ack_leased,
    ack_unlocked,
    archive_copies,
    delete_locked,
    finish_is_one_statement,
    finish_leased,
    lock_leased,
)
from .states import MessageState, held_token, state_filters


class AfterAck(Protocol):
    """What an acknowledging transaction runs once its workflow steps released others (a worker's claim).

    `begin` is called before each try of a transaction that may call
    `released`, so a try that failed after `released` is known; `released`
    inside the transaction, with the messages of the steps made ready.
    """

    def begin(self, using: str) -> None: ...

    def released(self, using: str, messages: list[LiveMessage]) -> None: ...


class Finishing(Leasing[Live]):
    """Deleting live messages and archiving them, atomically, under the guard each caller needs."""

    def finish(
        self, message: LiveMessage, outcome: str, match: str = "lease", **row: Any
    ) -> tuple[bool | None, ArchivedMessage | None]:
        """Delete ``message`` and archive it as ``outcome``, atomically.

        ``match`` picks the row to delete: ``"lease"`` only while the caller's
        lease holds, ``"token"`` while the lease token read earlier is still
        there (even run out: the reaper), ``"id"`` whoever holds it, ``"idle"``
        only while nobody runs it (operators).
        Returns whether it was there to delete, and the archive row written
        (None when archiving is off for an acked message). Whether it was is
        None when it cannot be known: an ack with archiving off whose reply
        was lost, of a message gone without a trace (`landed`).
        """
        using = message._state.db or "default"
        step = workflows.step_of(message)  # a Python test: an ordinary message runs no workflow statement
        if match == "lease" and step is None and not events.listened(events.signal_of(outcome)):
            return self._finish_quietly(message, outcome, row), None
        guard = {
            "lease": lambda: self.using(using).leased(message),
            "token": lambda: self.using(using).filter(pk=message.pk, lease_token=message.lease_token),
            "id": lambda: self.using(using).filter(pk=message.pk),
            "idle": lambda: self.using(using).filter(pk=message.pk).exclude(state_filters()[MessageState.IN_FLIGHT]),
        }[match]()
        archived: list[ArchivedMessage] = []

        def change() -> bool | None:
            archived.clear()
            with write_transaction(using):
                # _raw_delete: one DELETE, no collector SELECT (nothing cascades from messages).
                if guard._raw_delete(using) != 1:
                    return False
                if outcome != Outcome.ACKED or queue_options(message.queue).archive:
                    archived.append(ArchivedMessage.from_live(message, outcome, **row))
                    archived[0].save(using=using, force_insert=True)
                if step is not None:  # the join, in this transaction (models/workflows.py)
                    error = row.get("error")
                    reason = message.last_error if error is None else error
                    workflows.settle_step(using, step, message.pk, outcome, row.get("result"), reason)
                return True

        def found() -> bool | None:
            # Message ids are never reused: this id, claim time, outcome and finisher are this call's row.
            answer = self.using(using)._finished(message, outcome, row.get("worker"))
            if answer:
                stored = landed.finished_row(using, message, outcome, row.get("worker"))
                archived[:] = [stored] if stored is not None else []
            return answer

        miss: bool | None = False

        def run() -> bool | None:
            return landed.guarded(using, message, change, found, miss)

        done = with_retries(using, run, what=f"{outcome} message {message.pk}")
        return done, (archived[0] if archived and done else None)

    def _finished(self, message: LiveMessage, outcome: str, worker: str | None) -> bool | None:
        """Whether ``message``'s lease finished it as ``outcome``; None: unknown (`landed`)."""
        done, unknown = landed.finished(self.db, self, [message], outcome, worker)
        return None if message.pk in unknown else message.pk in done

    def _finish_quietly(self, message: LiveMessage, outcome: str, row: Mapping[str, Any]) -> bool | None:
        """`finish` under the lease with nobody listening: hand-written, no archive row object built.

        The row written is the one `ArchivedMessage.from_live` makes.
        """
        using = message._state.db or "default"
        held_token(message)
        archived: dict[str, Any] | None = None
        if outcome != Outcome.ACKED or queue_options(message.queue).archive:
            kept, why = validation.storable_result(row.get("result"))
            error = row.get("error")
            error = message.last_error if error is None else error
            if why is not None:
                error = f"{error}\nresult not kept: {why}".strip()
            archived = {
                "finished_by": row.get("worker") or message.claimed_by,
                "last_error": validation.storable_text(error),
                "result": kept,
            }
        one_statement = archived is None or finish_is_one_statement(using)
        on = self.using(using)

        def change() -> bool | None:
            with contextlib.nullcontext() if one_statement else short_transaction(using):
                return finish_leased(using, message, outcome, archived)

        def found() -> bool | None:
            return on._finished(message, outcome, row.get("worker"))

        miss: bool | None = False
        return with_retries(
            using, lambda: landed.guarded(using, message, change, found, miss), what=f"{outcome} message {message.pk}"
        )

    def ack_many(
        self,
        messages: Iterable[LiveMessage],
        *,
        worker: str | None = None,
        results: Mapping[int, Any] | None = None,
        then: AfterAck | None = None,
    ) -> list[bool | None]:
        """Acknowledge a batch, one transaction per database; per message, whether its lease held
        (None: unknown, as `finish` says). ``then``: what runs in each acknowledging transaction after
        workflow steps released others (`AfterAck`)."""
        messages = list(messages)
        answers: list[bool | None] = [False] * len(messages)
        for batch in _distinct_rounds(messages):
            by_db: dict[str, list[tuple[int, LiveMessage]]] = defaultdict(list)
            for index, message in batch:
                by_db[message._state.db or "default"].append((index, message))
            for using, entries in by_db.items():
                group = [m for _, m in entries]
                acked, unknown = self.using(using).ack_batch(group, worker or "", results or {}, then)
                for index, message in entries:
                    answers[index] = None if message.pk in unknown else message.pk in acked
                if acked and events.listened(signals.message_acked):
                    # The rows were copied inside the database: read them back, only for listeners.
                    stored = ArchivedMessage.objects.using(using).filter(message_id__in=acked, outcome=Outcome.ACKED)
                    rows_by_id = {row.message_id: row for row in stored.order_by("id")}
                    for m in group:
                        if m.pk in acked:
                            row = {"result": (results or {}).get(m.pk), "worker": worker}
                            events.finished(m, Outcome.ACKED, rows_by_id.get(m.pk), row)
        return answers

    def ack_batch(
        self, messages: Sequence[LiveMessage], worker: str, results: Mapping[int, Any], then: AfterAck | None = None
    ) -> tuple[set[int], set[int]]:
        """Acknowledge messages of one database in one transaction; returns the ids whose lease held, and
        those whose answer is unknown (a lost reply's, as `finish` says).

        Workflow steps among them are settled in the same transaction, all
        together (`workflows.settle_many`): a batch without a step runs the
        statements it always ran.
        """
        using = self.db
        steps = [(m, ref) for m in messages if (ref := workflows.step_of(m)) is not None]

        def settle(owned: set[int]) -> set[int]:
            # The join, in the acknowledging transaction (models/workflows.py).
            released = workflows.settle_many(
                using, [(ref, m.pk, Outcome.ACKED, results.get(m.pk), "") for m, ref in steps if m.pk in owned]
            )
            if then is not None and released:
                then.released(using, released)
            return owned

        tokens: dict[str, list[int]] = defaultdict(list)
        for message in messages:
            tokens[held_token(message)].append(message.pk)  # refuses a message never claimed
        kept: dict[int, Any] = {}
        notes: dict[int, str] = {}
        for message in messages:
            value, why = validation.storable_result(results.get(message.pk))
            if why is not None:
                notes[message.pk] = validation.storable_text(f"{message.last_error}\nresult not kept: {why}".strip())
            elif value is not None:
                kept[message.pk] = value
        # The archive rows are copied from the live ones: first write what handlers
        # reported since the last heartbeat (nothing, for handlers that do not report).
        for message in messages:
            unreported = message.unreported()
            if unreported is not None:
                count, values = unreported
                pk, token = message.pk, held_token(message)
                with_retries(using, lambda: self.write_report(pk, token, values), what="progress of a batch")  # noqa: B023
                message.reported(count)

        archived = [m.pk for m in messages if queue_options(m.queue).archive]

        def answered(write: Callable[[], set[int]]) -> tuple[set[int], set[int]]:
            # A try whose reply was lost may have acked them: what the database holds answers (.landed).
            unknown: set[int] = set()
            if then is not None and steps:
                then.begin(using)
            with landed.watching(using, messages):
                owned = write()
                missed = [m for m in messages if m.pk not in owned and landed.unsure(m)]
                if missed:
                    done, unknown = landed.finished(using, self, missed, Outcome.ACKED, worker)
                    owned = owned | done
            landed.settled(messages)
            return owned, unknown

        everyone = {m.pk for m in messages}
        if ack_in_one_statement(using):

            def one() -> set[int]:
                if not steps:
                    return ack_leased(using, tokens, archived, worker, kept, notes).get()
                try:  # the steps' statements go out with the ack's, as if every lease held (almost always)
                    with short_transaction(using), cursors.grouping(using):
                        ack_leased(using, tokens, archived, worker, kept, notes, _all_of(everyone))
                        return settle(everyone)
                except _LeaseMoved:  # rolled back: the ack first, then the steps of what it acked
                    pass
                with short_transaction(using):
                    return settle(ack_leased(using, tokens, archived, worker, kept, notes).get())

            return with_retries(using, lambda: answered(one), what="ack_many")

        def write() -> set[int]:
            # Every lease holds, almost always: acknowledge without locking first; else roll back and lock.
            try:
                with short_transaction(using):
                    acked = ack_unlocked(using, tokens, archived, worker, kept, notes, _LeaseMoved)
                    if steps:  # their statements go out with the ack's, which refuses them all if a lease moved
                        settle(everyone)
                    acked.get()
                    return everyone
            except _LeaseMoved:
                pass
            with short_transaction(using):
                owned = lock_leased(using, tokens)
                if not owned:
                    return owned
                archive_copies(using, [pk for pk in archived if pk in owned], Outcome.ACKED, worker, kept, notes)
                delete_locked(using, owned)
                return settle(owned) if steps else owned

        return with_retries(using, lambda: answered(write), what="ack_many")

    def expire_batch(self, limit: int) -> tuple[list[Live], list[ArchivedMessage]]:
        """Archive, as expired, up to ``limit`` messages past ``expires_at`` that nobody holds."""
        using = self.db

        def run() -> tuple[list[Live], list[ArchivedMessage]]:
            with write_transaction(using):
                rows = list(
                    self.select_for_update(skip_locked=True)
                    .filter(expires_at__lte=DbNow())
                    .filter(Q(lease_token__isnull=True) | Q(available_at__lte=DbNow()))
                    .order_by("expires_at")[:limit]
                )
                if not rows:
                    return [], []
                self.filter(pk__in=[m.pk for m in rows])._raw_delete(using)
                archived = [
                    ArchivedMessage.from_live(m, Outcome.EXPIRED, worker="reaper", error=m.last_error) for m in rows
                ]
                ArchivedMessage.objects.using(using).bulk_create(archived)
                steps = [(ref, m.pk, Outcome.EXPIRED, None, "expired") for m in rows if (ref := workflows.step_of(m))]
                if steps:  # the join, in this transaction, for the batch at once, as an ack's (models/workflows.py)
                    workflows.settle_many(using, steps)
                return rows, archived

        return with_retries(using, run, what="expiry")


def _distinct_rounds(messages: list[LiveMessage]) -> list[list[tuple[int, LiveMessage]]]:
    """The batch (with each message's place in it) in rounds that hold each message id once.

    A batch acknowledged together is answered by id, so two handles of one
    message (a stale claim's and the live one's) go in separate rounds: each
    is answered by its own lease, and at most one of them holds. Almost
    always there is one round.
    """
    rounds: list[list[tuple[int, LiveMessage]]] = []
    seen: list[set[int]] = []
    for index, message in enumerate(messages):
        slot = next((n for n, ids in enumerate(seen) if message.pk not in ids), len(rounds))
        if slot == len(rounds):
            rounds.append([])
            seen.append(set())
        rounds[slot].append((index, message))
        seen[slot].add(message.pk)
    return rounds


class _LeaseMoved(Exception):
    """A batch's unlocked acknowledgement found a lease that no longer held: rolls it back."""


def _all_of(expected: set[int]) -> Callable[[Any], set[int]]:
    """The answer of a PostgreSQL ack (the ids it deleted), refused with `_LeaseMoved` unless it is ``expected``."""

    def check(cursor: Any) -> set[int]:
        ids = {row[0] for row in cursor.fetchall()}
        if ids != expected:
            raise _LeaseMoved(f"{len(ids)} leases held of {len(expected)}")
        return ids

    return check
