"""One consumer thread: claim a batch, run each message, write its outcome.

Each consumer has its own database connection for the worker's life. It
claims up to ``batch_size`` messages, runs them one after another through
:mod:`django_dbqueue.running`, and writes each outcome as the handler ends,
except acknowledgements of a batch: those are written together, in one
transaction, when the batch is done. What it holds is in the worker's
:class:`~.ledger.Ledger`; idle, it waits with a doubling backoff, or until
woken (a NOTIFY, a stop).
"""

from __future__ import annotations

import logging
import time
from functools import partial

from django.db import connections

from ..db.errors import DATABASE_TROUBLE
from ..exceptions import DbQueueError
from ..models import Message, QueueState
from ..running import HandlerOutcome, Verdict, decide
from .config import WorkerConfig
from .ledger import Ledger
from .lifecycle import Lifecycle
from .writing import GaveUp, Writer

logger = logging.getLogger("django_dbqueue")

PAUSED_REFRESH = 1.0  # seconds between reads of the paused queues (one query, not one per claim)


class PausedQueues:
    """Which queues an operator paused, read at most once a second and shared by a worker's consumers."""

    def __init__(self, using: str) -> None:
        self.using = using
        self._read: tuple[float, frozenset[str]] = (float("-inf"), frozenset())

    def names(self) -> frozenset[str]:
        read_at, names = self._read
        now = time.monotonic()
        if now - read_at > PAUSED_REFRESH:
            names = frozenset(QueueState.objects.using(self.using).paused_names())
            self._read = (now, names)  # one assignment: threads see the old pair or the new one
        return names


class Consumer:
    """The claim/run/ack loop of one thread; ``slot`` is its key in the ledger."""

    def __init__(
        self,
        slot: int,
        *,
        name: str,
        queues: list[str],
        using: str,
        config: WorkerConfig,
        poll_interval: float,
        max_poll_interval: float,
        ledger: Ledger,
        lifecycle: Lifecycle,
        paused: PausedQueues,
    ) -> None:
        self.slot = slot
        self.name = name
        self.queues = queues
        self.using = using
        self.config = config
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.paused = paused
        self.writer = Writer(using, name, give_up=lifecycle.finished)
        # With batches, acks are written together when the batch is done: one
        # transaction instead of one per message. Their leases stay held until then.
        self.batched_acks = config.batch_size > 1

    def run(self) -> None:
        stopping = self.lifecycle.stopping
        idle_for = 0.0
        try:
            while not stopping.is_set():
                try:
                    claimed = self.claim()
                except DATABASE_TROUBLE as exc:
                    self.writer.pause("claim", exc)
                    continue
                if not claimed:
                    if self.nothing_left():
                        break
                    idle_for = min(max(idle_for * 2, self.poll_interval), self.max_poll_interval)
                    self.lifecycle.wake.wait(idle_for)
                    self.lifecycle.wake.clear()
                    continue
                idle_for = 0.0
                self.ledger.claimed(self.slot, claimed)
                while not stopping.is_set():
                    message = self.ledger.start(self.slot)
                    if message is None:
                        break
                    try:
                        self.process(message)
                    except GaveUp as exc:
                        logger.warning("worker %s: message %s not recorded (%s)", self.name, message.pk, exc)
                    except Exception:  # a bug of ours must not stop the thread; the lease will expire
                        logger.exception("worker %s: could not process message %s", self.name, message.pk)
                    finally:
                        self.ledger.finish(self.slot)  # not counted unless process() counted it
                self.flush()
        finally:
            try:
                self.flush()
            finally:
                connections.close_all()

    def claim(self) -> list[Message]:
        """Claim what this thread may take now: a batch of the unpaused queues, within --max-messages."""
        self._check_connection()
        paused = self.paused.names()
        queues = [q for q in self.queues if q not in paused]
        if not queues:
            return []
        limit = self.ledger.room(self.config.batch_size, self.config.max_messages)
        if limit <= 0:
            return []
        return Message.objects.claim(queues, limit, visibility_timeout=self.config.visibility_timeout, worker=self.name)

    def nothing_left(self) -> bool:
        """Whether the worker should stop for lack of work (--until-empty, --max-messages); stops it if so."""
        max_messages = self.config.max_messages
        if max_messages and self.ledger.counts().total >= max_messages:
            self.lifecycle.stop("max messages reached")
            return True
        if not self.config.until_empty or not self.ledger.is_empty():
            return False
        if Message.objects.using(self.using).any_claimable(self.queues):
            return False
        self.lifecycle.stop("queues are empty")
        return True

    def process(self, message: Message) -> None:
        """Run the (running) message's handler and write its outcome, or leave its ack to the batch."""
        started = time.monotonic()
        verdict = decide(message, worker=self.name, handler=self.config.handler)
        if self.batched_acks and verdict.outcome == HandlerOutcome.ACKED:
            self.ledger.await_ack(self.slot, verdict)
            outcome = "acked (written with its batch)"
        else:
            outcome = self.record(message, verdict)
            self.ledger.finish(self.slot, ok=outcome in (HandlerOutcome.ACKED, HandlerOutcome.DEFERRED))
        logger.debug(
            "message %s (%s/%s) attempt %d: %s in %.3fs",
            message.pk,
            message.queue,
            message.kind,
            message.attempts,
            outcome,
            time.monotonic() - started,
        )

    def record(self, message: Message, verdict: Verdict) -> str:
        """Write the handler's outcome, waiting out a database outage; returns the outcome written."""
        while True:
            try:
                return self.writer.until_written(verdict.record, f"recording message {message.pk} as {verdict.outcome}")
            except DbQueueError as exc:
                # The handler asked for something invalid (a naive Defer date, a
                # negative Retry delay): that is the handler's failure.
                logger.warning("message %s: handler's %s is invalid: %s", message.pk, verdict.outcome, exc)
                verdict = Verdict(HandlerOutcome.FAILED, partial(message.fail, exc))

    def flush(self) -> None:
        """Write the batch's waiting acks in one transaction, waiting out a database outage."""
        batch = self.ledger.unacked(self.slot)
        if not batch:
            return
        messages = [message for message, _ in batch]
        results = {message.pk: verdict.result for message, verdict in batch}
        try:
            held = self.writer.until_written(
                lambda: Message.objects.ack_many(messages, worker=self.name, results=results),
                f"acknowledging {len(messages)} messages",
            )
        except GaveUp as exc:  # still in the ledger: the worker row stays, and the reaper gives them back
            logger.warning("worker %s: acks of messages %s not written (%s)", self.name, [m.pk for m in messages], exc)
            return
        self.ledger.acked(self.slot, held)
        for (_, verdict), ok in zip(batch, held, strict=True):
            verdict.written(HandlerOutcome.ACKED if ok else HandlerOutcome.LEASE_LOST)
        lost = [message.pk for message, ok in zip(messages, held, strict=True) if not ok]
        if lost:
            logger.warning("worker %s: leases lost before the ack of messages %s", self.name, lost)

    def _check_connection(self) -> None:
        """Keep one connection per thread for the worker's life; reopen it only when it broke.

        Django's ``close_old_connections()`` would close it before every claim
        when CONN_MAX_AGE is 0 (its default): a new connection per batch.
        """
        connection = connections[self.using]
        if connection.connection is not None and connection.errors_occurred:
            if connection.is_usable():
                connection.errors_occurred = False
            else:
                connection.close()
