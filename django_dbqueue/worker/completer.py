"""Acknowledgements written beside the consumers, on one thread per worker.

A consumer used to write the acks of its batch itself and only then claim
the next batch: two transactions, one after the other. Handed to the
completer, the acks are written while the consumer claims and runs the
next batch, so the round trips of the two overlap (docs/benchmarks.md,
"Completer"). Batches handed over while another is being written are
written together next, in one transaction.

What recording an outcome promises stays (docs/workers.md, "Recording an
outcome"): each ack holds its lease guard, and a message counts as
processed once its ack is written; weather is waited out; handovers that
cannot be written together are written each alone, and a batch that
cannot be written together is written one message at a time through its
consumer's ``record``; a lost lease (or an ack unknown) is logged once.

Bounded: a consumer waits for its last handover to be written before it
hands over the next one, so at most one batch per consumer waits here, and
a consumer ends only once its last handover is written. If this thread
ends without writing a handover, its consumer is told (`CompleterGone`)
instead of waiting for ever; the messages stay in the ledger and their
leases expire.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from ..models import Message
from ..models.workflows import STEP_PRESENT, check_steps
from ..running import HandlerOutcome, Verdict, written_as
from .ledger import Ledger
from .lifecycle import Lifecycle
from .writing import GaveUp, Writer, first_line, warn_unwritten

logger = logging.getLogger("django_dbqueue")

# The most messages written together in one transaction (whole handovers; at least one).
MERGE_LIMIT = 1000
# How often a consumer waiting for its handover checks that the completer thread still runs.
CHECK_EVERY = 1.0

Entry = tuple[Message, Verdict]


class CompleterGone(Exception):
    """The completer ended (crashed, or the worker is exiting) without writing a handover."""


@dataclass(frozen=True)
class ClaimAfter:
    """A consumer's claim, to run in its acks' transaction when their workflow steps release others
    (`Claiming.ack_then_claim`): the unpaused queues it serves, how many, for how long."""

    queues: list[str]
    limit: int
    visibility_timeout: float | None
    max_messages: int | None = None  # the worker's --max-messages: the limit is checked again at the write


@dataclass(eq=False)
class Handover:
    """One consumer's batch of acks: ``record`` writes one outcome alone (its consumer's `record`);
    ``claim``: its claim after them, if any (`ClaimAfter`)."""

    slot: int
    batch: list[Entry]
    record: Callable[[Message, Verdict], str]
    claim: ClaimAfter | None = None
    took: int = 0  # how many messages its claim took
    done: threading.Event = field(default_factory=threading.Event)
    settled: bool = False  # written, or given up and logged: the completer is done with it


class Completer:
    """Writes handed-over acks on its own thread and connection; `run` is that thread's loop."""

    def __init__(self, *, name: str, using: str, ledger: Ledger, lifecycle: Lifecycle) -> None:
        self.name = name
        self.using = using
        self.ledger = ledger
        self.writer = Writer(using, name, give_up=lifecycle.finished)
        self._changed = threading.Condition()
        self._waiting: list[Handover] = []
        self._closed = False
        self._ended = False

    # --- consumers -----------------------------------------------------------------

    def hand_over(
        self,
        slot: int,
        batch: list[Entry],
        record: Callable[[Message, Verdict], str],
        claim: ClaimAfter | None = None,
    ) -> Handover:
        """Queue ``batch`` (the slot's unacked messages) to be acknowledged; wait for it with `wait`.

        ``claim``: where the acks release workflow steps, the slot's claim in their transaction; what it
        takes is in the ledger, the slot's, before `wait` returns.
        """
        handover = Handover(slot, batch, record, claim)
        with self._changed:
            if self._closed or self._ended:
                raise CompleterGone("the worker is exiting; these acks are not written and their leases will expire")
            self._waiting.append(handover)
            self._changed.notify()
        return handover

    def wait(self, handover: Handover) -> None:
        """Until ``handover`` is written, or given up; raises `CompleterGone` if it never will be."""
        while not handover.done.wait(CHECK_EVERY):
            with self._changed:
                if self._ended and not handover.done.is_set():
                    raise CompleterGone("the completer thread ended before writing these acks")
        if not handover.settled:
            raise CompleterGone("the completer thread ended before writing these acks")

    # --- the completer's thread ----------------------------------------------------------

    def close(self) -> None:
        """No more handovers: `run` writes what waits, then returns."""
        with self._changed:
            self._closed = True
            self._changed.notify()

    def run(self) -> None:
        taken: list[Handover] = []
        try:
            while True:
                with self._changed:
                    while not self._waiting and not self._closed:
                        self._changed.wait()
                    if not self._waiting:
                        return
                    taken = self._take()
                self.write(taken)
                taken = []
        finally:
            with self._changed:
                self._ended = True
                left, self._waiting = taken + self._waiting, []
            for handover in left:
                handover.done.set()  # not written: its consumer's wait() raises
            connections.close_all()

    def _take(self) -> list[Handover]:
        """Whole handovers from the oldest, up to `MERGE_LIMIT` messages (at least one)."""
        taken: list[Handover] = []
        size = 0
        while self._waiting and (not taken or size + len(self._waiting[0].batch) <= MERGE_LIMIT):
            handover = self._waiting.pop(0)
            taken.append(handover)
            size += len(handover.batch)
        return taken

    def write(self, handovers: list[Handover]) -> None:
        """Acknowledge ``handovers`` in one transaction; apart, when they cannot be written together."""
        entries = [entry for handover in handovers for entry in handover.batch]
        messages = [message for message, _ in entries]
        results = {message.pk: verdict.result for message, verdict in entries}
        # The first consumer that asks gets the claim (one consumer per worker but for --threads).
        claimant = next((handover for handover in handovers if handover.claim is not None), None)
        claim = claimant.claim if claimant is not None else None
        try:
            # What other threads claimed since the hand-over counts against --max-messages too.
            limit = self.ledger.room(claim.limit, claim.max_messages) if claim is not None else 0
            if claimant is None or claim is None or limit <= 0:
                held = self.writer.until_written(
                    lambda: Message.objects.ack_many(messages, worker=self.name, results=results),
                    f"acknowledging {len(messages)} messages",
                )
            else:
                held = self._ack_then_claim(claimant, claim, limit, messages, results)
        except GaveUp as exc:  # still in the ledger: the worker row stays, and the reaper gives them back
            logger.warning("worker %s: acks of messages %s not written (%s)", self.name, [m.pk for m in messages], exc)
            self._done(handovers)
            return
        except Exception as exc:
            if len(handovers) > 1:  # one consumer's batch holds what cannot be stored: the others go through
                for handover in handovers:
                    self.write([handover])
                return
            logger.warning(
                "worker %s: the acks of messages %s cannot be written together (%s: %s); writing them one by one",
                self.name,
                [m.pk for m in messages],
                type(exc).__name__,
                first_line(exc),
            )
            self._one_by_one(handovers[0])
            return
        start = 0
        for handover in handovers:
            part, start = held[start : start + len(handover.batch)], start + len(handover.batch)
            self.ledger.acked(handover.slot, part)
            for (message, verdict), ok in zip(handover.batch, part, strict=True):
                outcome = written_as(HandlerOutcome.ACKED, ok)
                verdict.written(outcome)
                if outcome != HandlerOutcome.ACKED:
                    warn_unwritten(self.name, message, HandlerOutcome.ACKED, outcome)
        self._done(handovers)

    def _ack_then_claim(
        self, claimant: Handover, claim: ClaimAfter, limit: int, messages: list[Message], results: dict[int, Any]
    ) -> list[bool | None]:
        """The acks with ``claimant``'s claim after them (`Claiming.ack_then_claim`), under one claim token
        for every try: a try whose reply was lost is answered by the leases under it. The slot's acks are in
        hand until `Ledger.acked`, so the worker is never empty in between. If no try is answered, what the
        token leased is read back and held all the same (best effort: else those leases expire)."""
        token = uuid.uuid4().hex
        tries = 0

        def write() -> tuple[list[bool | None], list[Message]]:
            nonlocal tries
            tries += 1
            return Message.objects.ack_then_claim(
                messages,
                claim.queues,
                limit,
                worker=self.name,
                results=results,
                visibility_timeout=claim.visibility_timeout,
                token=token,
                again=tries > 1,
            )

        try:
            held, taken = self.writer.until_written(write, f"acknowledging {len(messages)} messages")
        except BaseException:
            if tries:
                self._recover(claimant.slot, token)
            raise
        self._hold(claimant.slot, taken)
        claimant.took = len(taken)
        return held

    def _recover(self, slot: int, token: str) -> None:
        """Hold what a claim after acks that ended in an error leased under ``token`` (it may have committed)."""
        try:
            taken = list(Message.objects.using(self.using).claimed_under(token))
        except Exception as exc:
            logger.warning(
                "worker %s: could not read back what its claim after acks leased (%s); those leases will expire",
                self.name,
                first_line(exc),
            )
            return
        self._hold(slot, taken)

    def _hold(self, slot: int, taken: list[Message]) -> None:
        """Put what a claim in the acks' transaction took in ``slot``'s hands; look up the step rows its
        claim did not just read (`check_steps`, as a consumer's claim does)."""
        if not taken:
            return
        self.ledger.claimed(slot, taken)
        unknown = [m for m in taken if STEP_PRESENT not in m.__dict__]
        try:
            check_steps(self.using, unknown)
        except Exception as exc:  # best effort: each step then looks its row up before it runs (orphan_reason)
            logger.warning("worker %s: could not look up the claimed steps' rows at once: %s", self.name, exc)

    def _one_by_one(self, handover: Handover) -> None:
        written: list[bool] = []
        try:
            for message, verdict in handover.batch:
                written.append(handover.record(message, verdict) == HandlerOutcome.ACKED)
        except GaveUp as exc:  # the rest stay in the ledger, as above
            logger.warning("worker %s: acks not written (%s)", self.name, exc)
        finally:
            self.ledger.acked(handover.slot, written)
            self._done([handover])

    @staticmethod
    def _done(handovers: list[Handover]) -> None:
        for handover in handovers:
            handover.settled = True
            handover.done.set()
