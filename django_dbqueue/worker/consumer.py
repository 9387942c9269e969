"""One consumer thread: claim a batch, run each message, write its outcome.

Each consumer has its own database connection for the worker's life. It
claims up to ``--batch-size`` messages (without it, as many as its
handlers' recent durations say, `sizing`), runs them one after another through
`django_dbqueue.running`, and writes each outcome as the handler ends,
except acknowledgements: when the batch is done, its acks are handed to the
worker's `Completer`, which writes them in one
transaction while this thread claims the next batch. What it holds is in the worker's
`Ledger`; idle, it waits with a doubling backoff, or until
woken (a NOTIFY, a stop).

Recording an outcome never wedges the thread (docs/workers.md, "Recording
an outcome"): weather is waited out (`writing`); a permanent error is
written once as something else (`unstorable`); a batch that cannot be
acknowledged together is acknowledged one by one; a lost lease, including a
handler's own ``release()``, ``fail()`` or ``ack()``, is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from functools import partial
from typing import TYPE_CHECKING

from django.db import connections

from ..conf import queue_options
from ..console import MESSAGES, event
from ..db.errors import DATABASE_TROUBLE
from ..exceptions import DbQueueError
from ..handlers import find_handler, is_async
from ..models import Message, QueueState
from ..models.workflows import check_steps, step_of
from ..running import HandlerOutcome, Verdict, decide, ends_dead
from .completer import ClaimAfter, Completer, CompleterGone, Handover
from .config import WorkerConfig
from .ledger import Ledger
from .lifecycle import Ending, Lifecycle
from .recycling import Recycler
from .sizing import ClaimSizer, give_back, stays_in_batch
from .writing import GaveUp, Writer, first_line, warn_unwritten

if TYPE_CHECKING:
    from .asyncloop import EventLoop

logger = logging.getLogger("django_dbqueue")
# A line per finished message: its own logger, so a project can set its level apart (docs/workers.md).
message_logger = logging.getLogger(MESSAGES)

# What record() returns when nothing at all could be written (the lease will expire).
NOT_RECORDED = "not recorded"
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
        completer: Completer,
        recycler: Recycler | None = None,
        event_loop: EventLoop | None = None,
        served: list[str] | None = None,
    ) -> None:
        self.slot = slot
        self.name = name
        self.queues = queues
        # Every queue of the worker: "empty" (--until-empty) is decided over them all, not this thread's share.
        self.served = served or queues
        self.using = using
        self.config = config
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.paused = paused
        self.writer = Writer(using, name, give_up=lifecycle.finished)
        # Acks are written by the completer, a batch at a time; their leases stay held until then.
        self.completer = completer
        self.recycler = recycler  # a pool's child's limits, checked between messages
        # The worker's event loop: where an async handler of a queue this thread claims runs.
        self.event_loop = event_loop
        self._handed: Handover | None = None  # the last batch handed over, until it is written
        # flush() and settle() run on this thread, and on the batch watch's when a handler runs long.
        self._handing = threading.RLock()
        # Whether the last claim in an acks' transaction took something (`claim_after`): while it does
        # (a chain), the thread waits for its acks before claiming, instead of claiming beside them.
        self._chained = False
        single = any(queue_options(q).max_attempts == 1 or queue_options(q).rate_limit for q in queues)
        self.sizer = ClaimSizer(config.batch_size, one_at_a_time=single)

    def run(self) -> None:
        stopping = self.lifecycle.stopping
        idle_for = 0.0
        try:
            while not stopping.is_set():
                try:
                    if self._handed is not None and self._handed.claim is not None and self.wait_for_claim():
                        self.settle()  # the acks and their claim first (`wait_for_claim`)
                    # Held already: the claim in the last acks' transaction took them (`claim_after`).
                    held = self.ledger.unstarted(self.slot)
                    claimed = [] if held else self.claim()
                    if not held and not claimed and self.settle():
                        continue  # acks were being written (a group's next message waits for them): claim again
                    if not held and not claimed and self.nothing_left():
                        break
                except DATABASE_TROUBLE as exc:
                    self.writer.pause("claim", exc)
                    continue
                if not held and not claimed:
                    idle_for = min(max(idle_for * 2, self.poll_interval), self.max_poll_interval)
                    # A rate limit that held messages back says when its next slot is free.
                    retry_in = getattr(claimed, "retry_in", None)
                    self.lifecycle.wake.wait(idle_for if retry_in is None else min(idle_for, retry_in + 0.001))
                    self.lifecycle.wake.clear()
                    continue
                idle_for = 0.0
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
                    if self.recycler is not None:
                        self.recycler.check(self.ledger)
                self.flush()
        finally:
            try:
                self.flush()
                self.settle()
            finally:
                connections.close_all()

    def claim(self, wanted: int | None = None) -> list[Message]:
        """Claim what this thread may take now: a batch (``wanted``, else --batch-size or the adaptive
        size, see `sizing`) of the unpaused queues, within --max-messages.

        The claim is in the ledger from before it starts until its messages
        are handed over (`Ledger.claiming`): its rows are leased when
        its transaction commits, and until the handover no other thread may
        take the worker for idle. An adaptive batch keeps no message on its
        last attempt behind another: those are given back inside the claim.
        """
        self._check_connection()
        paused = self.paused.names()
        queues = [q for q in self.queues if q not in paused]
        if not queues:
            return []
        limit = self.ledger.room(wanted or self.sizer.size(), self.config.max_messages)
        if limit <= 0:
            return []
        with self.ledger.claiming(self.slot) as allowed:
            if not allowed:  # another thread is deciding that the queues are empty
                return []
            claimed = Message.objects.claim(
                queues, limit, visibility_timeout=self.config.visibility_timeout, worker=self.name
            )
            if self.sizer.adaptive and wanted is None and len(claimed) > 1:
                last = [m for m in claimed[1:] if not stays_in_batch(m)]
                if last:
                    kept = give_back(last, self.name, "on its last attempt")  # refused: it stays, to run
                    claimed[:] = [m for m in claimed if m not in last or m in kept]
            self.ledger.claimed(self.slot, claimed)
        try:
            check_steps(self.using, claimed)  # workflow steps' rows: one lookup for the batch, not one per step
        except Exception as exc:  # best effort: each step then looks its row up before it runs (orphan_reason)
            logger.warning("worker %s: could not look up the claimed steps' rows at once: %s", self.name, exc)
        return claimed

    def nothing_left(self) -> bool:
        """Whether the worker should stop for lack of work (--until-empty, --max-messages); stops it if so.

        "Empty" is decided with the ledger closed (`Ledger.close_if_empty`):
        no thread of this worker holds a message or is claiming one, and none
        may start a claim, while the table is read. So a claim that committed
        but was not handed over yet cannot be taken for an empty queue, and
        every outcome this worker wrote (a retry ready at once) is in the table.
        """
        max_messages = self.config.max_messages
        if max_messages and self.ledger.counts().total >= max_messages:
            self.lifecycle.stop("max messages reached", Ending.RECYCLE)
            return True
        if not self.config.until_empty or not self.ledger.close_if_empty():
            return False
        empty = False
        try:
            empty = not Message.objects.using(self.using).any_claimable(self.served)
        finally:
            if not empty:
                self.ledger.reopen()
        if empty:
            self.lifecycle.stop("queues are empty", Ending.DONE)
        return empty

    def process(self, message: Message) -> None:
        """Run the (running) message's handler and write its outcome, or leave its ack to the batch."""
        started = time.monotonic()
        verdict = self.decide(message)
        self.sizer.ran(time.monotonic() - started)
        self.conclude(message, verdict, started)

    def decide(self, message: Message) -> Verdict:
        """The handler's verdict; an async handler runs on the worker's loop while this thread waits."""
        handler = self.config.handler or find_handler(message.queue, message.kind)
        if self.event_loop is not None and handler is not None and is_async(handler):
            return self.event_loop.submit(message, handler, self.name).result()
        return decide(message, worker=self.name, handler=self.config.handler)

    def conclude(self, message: Message, verdict: Verdict, started: float, key: Hashable | None = None) -> None:
        """Write ``verdict``, or leave its ack to the batch; ``key``: what the message runs under in the ledger."""
        key = self.slot if key is None else key
        dead = False
        if verdict.outcome == HandlerOutcome.ACKED and message.lease_token and not verdict.committed:
            self.ledger.await_ack(key, verdict, batch=self.slot)
            outcome = HandlerOutcome.ACKED  # written by the completer with its batch; a lost lease is logged then
        else:  # a handler that released or failed its own message left no lease token: "lease lost" at once;
            # an atomic handler's ack was written with its transaction (record() tells what it came to)
            outcome = self.record(message, verdict)
            dead = ends_dead(message, outcome)
            ok = outcome in (HandlerOutcome.ACKED, HandlerOutcome.DEFERRED)
            self.ledger.finish(key, ok=ok, dead=dead)
        log_finished(message, outcome, dead, verdict.error, time.monotonic() - started)

    def record(self, message: Message, verdict: Verdict) -> str:
        """Write the handler's outcome; when it cannot be stored, what can. Returns the outcome written.

        Weather is waited out (`Writer.until_written`). A permanent
        error is never retried: the message is recorded otherwise
        (`record_instead`) and the worker goes on with the next one.
        A lost lease (it ran out, or the handler released, failed or acked
        its own message) is logged once.
        """
        try:
            outcome = self.writer.until_written(verdict.record, f"recording message {message.pk} as {verdict.outcome}")
        except GaveUp:
            raise
        except DbQueueError as exc:
            # The handler asked for something invalid (a naive Defer date, a
            # Retry delay past ten years): that is the handler's failure.
            logger.warning("message %s: handler's %s is invalid: %s", message.pk, verdict.outcome, exc)
            instead = Verdict(HandlerOutcome.FAILED, partial(message.fail, exc))
            outcome = self.record_instead(message, verdict, instead, exc)
        except Exception as exc:
            logger.error(
                "worker %s: message %s: its outcome (%s) cannot be stored: %s",
                self.name,
                message.pk,
                verdict.outcome,
                exc,
                exc_info=exc,
            )
            outcome = self.record_instead(message, verdict, unstorable(message, verdict.outcome, exc), exc)
        if outcome in (HandlerOutcome.LEASE_LOST, HandlerOutcome.ACK_UNKNOWN):
            warn_unwritten(self.name, message, verdict.outcome, outcome)
        return outcome

    def record_instead(self, message: Message, verdict: Verdict, instead: Verdict, error: BaseException) -> str:
        """Write ``instead`` of the handler's outcome; if even that cannot be stored, a bare dead letter.

        If the bare dead letter fails too, nothing is written: the message
        leaves the ledger, its lease expires, and it runs again within its attempts.
        """
        for attempt in (instead, unstorable(message, verdict.outcome, error, bare=True)):
            attempt = Verdict(attempt.outcome, attempt.apply, recorded=verdict.recorded)
            try:
                return self.writer.until_written(attempt.record, f"recording message {message.pk} as {attempt.outcome}")
            except GaveUp:
                raise
            except Exception as exc:
                logger.error(
                    "worker %s: message %s: recording it as %s failed too: %s",
                    self.name,
                    message.pk,
                    attempt.outcome,
                    exc,
                    exc_info=exc,
                )
        return NOT_RECORDED

    def flush(self, *, then_claim: bool = True) -> None:
        """Hand the batch's waiting acks to the completer, once the last batch handed over is written.

        The completer writes them in one transaction while this thread
        claims and runs the next batch (see `completer` for what it does
        when they cannot be written). ``then_claim``: with a claim for
        this thread in their transaction, where it applies (`claim_after`).
        """
        with self._handing:
            self.settle()
            batch = self.ledger.unacked(self.slot)
            if not batch:
                return
            try:
                self._handed = self.completer.hand_over(
                    self.slot, batch, self.record, self.claim_after(batch) if then_claim else None
                )
            except CompleterGone as exc:  # still in the ledger: the worker row stays, the reaper gives them back
                pks = [m.pk for m, _ in batch]
                logger.warning("worker %s: acks of messages %s not written (%s)", self.name, pks, exc)

    def claim_after(self, batch: list[tuple[Message, Verdict]]) -> ClaimAfter | None:
        """This thread's claim, to run in the acks' transaction if their workflow steps release others.

        A chain's next step exists only once its parent's ack commits; the
        claim that follows in the same transaction takes it (or whatever the
        claim plan ranks first) without a transaction of its own. None while
        stopping, for a batch without a step, or with no room left. An
        adaptive size claims one there: a batch of more keeps a message on
        its last attempt behind others (`claim`).
        """
        if self.lifecycle.stopping.is_set() or not any(step_of(message) for message, _ in batch):
            return None
        try:
            paused = self.paused.names()
        except DATABASE_TROUBLE:  # the acks go alone; the next claim() reads the pauses, and waits out the weather
            return None
        # Flow rules' claims take locks of their own (groups, rate slots): not while the acks hold the join's.
        queues = [q for q in self.queues if q not in paused and not queue_options(q).flow_controlled]
        limit = self.ledger.room(1 if self.sizer.adaptive else self.sizer.size(), self.config.max_messages)
        if not queues or limit <= 0:
            return None
        return ClaimAfter(queues, limit, self.config.visibility_timeout, self.config.max_messages)

    def wait_for_claim(self) -> bool:
        """Whether to wait for the handed-over acks and their claim before claiming: while that claim takes
        this thread's next batch (a chain), a claim beside it would find nothing; with --max-messages, one
        beside it would not count what that claim takes, and could run more than the limit."""
        return self._chained or bool(self.config.max_messages)

    def flush_early(self) -> None:
        """Hand over the acks waiting in the ledger now, while this thread runs a long handler (the batch
        watch): the messages that ran before it in its batch are not held until it ends."""
        if self.ledger.unacked(self.slot):
            self.flush(then_claim=False)  # nothing more behind the long handler

    def settle(self) -> bool:
        """Wait until the last batch handed over is written; whether there was one."""
        with self._handing:
            handed, self._handed = self._handed, None
            if handed is None:
                return False
            self.completer.wait(handed)
            if handed.claim is not None:
                self._chained = handed.took > 0
            return True

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


# INFO: what the handler asked for, and a lost lease or an ack unknown (record() warned of it once already).
QUIET_OUTCOMES = (
    HandlerOutcome.ACKED,
    HandlerOutcome.DEFERRED,
    HandlerOutcome.RETRIED,
    HandlerOutcome.CANCELLED,
    HandlerOutcome.LEASE_LOST,
    HandlerOutcome.ACK_UNKNOWN,
)


def log_finished(message: Message, outcome: str, dead: bool, error: BaseException | str | None, took: float) -> None:
    """The line of one finished message: INFO when it went as the handler wanted, WARNING for a failed
    attempt, ERROR for a dead letter; a failure carries its error (and traceback)."""
    if dead:
        level = logging.ERROR
    elif outcome in QUIET_OUTCOMES or outcome == HandlerOutcome.UNHANDLED:  # unhandled and kept for later
        level = logging.INFO
    else:
        level = logging.WARNING
    if not message_logger.isEnabledFor(level):
        return
    what = f"{message.queue}/{message.kind}" if message.kind else message.queue
    attempts = f"attempt {message.attempts} of {message.max_attempts_allowed()}"
    shown = "dead" if dead else outcome
    retry_in = message.retry_in if outcome == HandlerOutcome.FAILED and not dead else None
    if retry_in is not None:
        attempts = f"{attempts}, retry in {retry_in:.1f}s"
    if isinstance(error, BaseException):
        said = f"{type(error).__name__}: {first_line(error)}" if str(error) else type(error).__name__
    else:  # a reason; one that holds a traceback (a task's) is told by its last line, the exception
        lines = (error or "").strip().splitlines()
        said = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""
    fields = {
        "id": message.pk,
        "queue": message.queue,
        "kind": message.kind,
        "outcome": shown,
        "attempt": message.attempts,
        "duration": round(took, 6),
    }
    if said and level > logging.INFO:
        fields["error"] = said
    if retry_in is not None:
        fields["retry_in"] = round(retry_in, 3)
    text = f"message {message.pk} {what} {shown} in {took:.3f}s ({attempts})"
    if said and (level > logging.INFO or outcome == HandlerOutcome.RETRIED):
        text = f"{text}: {said}"
    exc_info = error if isinstance(error, BaseException) and level > logging.INFO else None
    message_logger.log(level, "%s", text, exc_info=exc_info, extra=event("message", **fields))


def unstorable(message: Message, outcome: str, error: BaseException, *, bare: bool = False) -> Verdict:
    """What to write when ``outcome`` could not be stored because of ``error`` (a permanent error).

    An outcome that ends the message (an ack, a dead letter) is written as
    a dead letter: the handler succeeded, or asked for the message to end,
    and running it again would repeat its effects for the same failure to
    record them. Any other outcome (a failure, a retry, a deferral) is a
    failed attempt: retried after its backoff while attempts are left, dead
    after. ``bare``: the last resort, a dead letter whose reason is plain ASCII.
    """
    note = f"its outcome ({outcome}) could not be stored: {type(error).__name__}: {first_line(error)[:500]}"
    if bare:
        reason = ascii(f"the worker could not record this message; {note}")[1:-1][:1000]
        return Verdict(HandlerOutcome.REJECTED, partial(message.reject, requeue=False, reason=reason))
    if outcome == HandlerOutcome.ACKED:
        reason = f"the handler succeeded, but {note}"
        return Verdict(HandlerOutcome.REJECTED, partial(message.reject, requeue=False, reason=reason))
    if outcome == HandlerOutcome.REJECTED:
        return Verdict(HandlerOutcome.REJECTED, partial(message.reject, requeue=False, reason=note))
    return Verdict(HandlerOutcome.FAILED, partial(message.fail, note))
