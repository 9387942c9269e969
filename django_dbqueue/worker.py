"""The worker: threads that claim messages and run their handlers.

One :class:`QueueWorker` is one ``runqueueworker`` process. Its consumer
threads each hold their own database connection, claim in batches and run
each message through :mod:`django_dbqueue.dispatch`. A heartbeat thread
writes the ``Worker`` row and extends the leases of everything the worker
holds, so long work is not delivered twice; the reaper gives a silent
worker's messages back. On PostgreSQL a listener thread wakes idle
consumers on ``NOTIFY``; elsewhere they poll with a backoff.

Shutdown: the first SIGTERM/SIGINT stops claiming, releases claimed but
unstarted messages at once and lets running handlers finish within
``SHUTDOWN_GRACE``; a second signal exits at once (those leases expire).
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.db import connections

from . import handlers as handler_registry
from .conf import database_for, get_settings, queue_options
from .db import notify
from .db.errors import DATABASE_TROUBLE, backoff
from .running import HandlerOutcome as Outcome
from .running import Verdict, decide
from .exceptions import DbQueueError, InvalidOption
from .handlers import Handler
from .models import Message, QueueState
from .models import Worker as WorkerRow
from .operations import ack_many
from .validation import validate_queues

logger = logging.getLogger("django_dbqueue")


PAUSED_REFRESH = 1.0  # seconds between reads of the paused queues (one query, not one per claim)


class ExitStatus(enum.IntEnum):
    """The worker process's exit status: what happened."""

    OK = 0  # stopped as asked (signal, --until-empty, --max-messages, --max-runtime) with nothing left running
    ERROR = 1  # could not start or crashed
    ABANDONED = 3  # the grace period ran out with handlers still running; their leases will expire
    FORCED = 4  # a second signal: exited at once; leases of running messages will expire


@dataclass
class WorkerConfig:
    """Everything ``runqueueworker`` can be told; None means "from the DBQUEUE setting"."""

    queues: list[str] = field(default_factory=list)
    concurrency: int = 1
    batch_size: int = 1
    poll_interval: float | None = None
    max_poll_interval: float | None = None
    visibility_timeout: float | None = None
    until_empty: bool = False
    max_messages: int | None = None
    max_runtime: float | None = None
    grace: float | None = None
    handler: Handler | None = None  # overrides the registry (exec mode)
    reap: bool = False


class QueueWorker:
    """Runs handlers for messages of ``config.queues`` until told to stop."""

    def __init__(self, config: WorkerConfig) -> None:
        dbq = get_settings()
        self.config = config
        queues = config.queues or sorted({q for q, _ in handler_registry.registered()})
        if not queues:
            raise InvalidOption("no queues to serve: name them, or register handlers in an app's queues.py")
        self.queues = validate_queues(queues)
        self.using = database_for(self.queues)
        self.poll_interval = config.poll_interval or dbq.poll_interval
        self.max_poll_interval = max(config.max_poll_interval or dbq.max_poll_interval, self.poll_interval)
        self.grace = dbq.shutdown_grace if config.grace is None else config.grace
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.processed = 0
        self.failed = 0
        self.stopping = threading.Event()  # stop claiming
        self.finished = threading.Event()  # every consumer is done (heartbeats go on until then)
        self.wake = threading.Event()
        self._signalled = False
        self._previous_handlers: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._held: dict[int, deque[Message]] = {}  # per thread: claimed, not yet started
        self._running: dict[int, Message] = {}  # per thread: the message its handler runs
        self._acking: dict[int, list[tuple[Message, Verdict]]] = {}  # per thread: handled, ack not yet written
        self._paused: set[str] = set()
        self._paused_read_at = 0.0

    # --- lifecycle -----------------------------------------------------------

    def run(self) -> ExitStatus:
        """Start the threads, wait for a stop, shut down; returns the exit status."""
        started = time.monotonic()
        self._install_signals()
        self._register()
        consumers = [
            threading.Thread(target=self._consume, name=f"dbqueue-consumer-{n}", daemon=True)
            for n in range(self.config.concurrency)
        ]
        helpers = [threading.Thread(target=self._heartbeat, name="dbqueue-heartbeat", daemon=True)]
        if notify.can_listen(self.using):
            helpers.append(threading.Thread(target=self._listen, name="dbqueue-listener", daemon=True))
        if self.config.reap:
            helpers.append(threading.Thread(target=self._reap, name="dbqueue-reaper", daemon=True))
        logger.info(
            "worker %s serving %s with %d thread(s), batches of %d",
            self.name,
            ", ".join(self.queues),
            self.config.concurrency,
            self.config.batch_size,
        )
        for thread in consumers + helpers:
            thread.start()
        while not self.stopping.wait(0.2):
            if self.config.max_runtime and time.monotonic() - started >= self.config.max_runtime:
                self.stop("max runtime reached")
            if not any(t.is_alive() for t in consumers):
                self.stop("all consumer threads finished")
        status = self._shutdown(consumers)
        self.finished.set()
        for thread in helpers:
            thread.join(timeout=5)
        if status == ExitStatus.OK:
            self._unregister()
        # Otherwise handlers are still running: the row stays, its heartbeat goes silent, and
        # the reaper gives their messages back after WORKER_STALE_AFTER instead of a whole lease.
        connections.close_all()
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        logger.info(
            "worker %s exits (%s): %d processed, %d failed", self.name, status.name, self.processed, self.failed
        )
        return status

    def stop(self, why: str) -> None:
        if not self.stopping.is_set():
            logger.info("worker %s stopping: %s", self.name, why)
        self.stopping.set()
        self.wake.set()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # tests run workers in threads; signals only reach the main thread

        def on_signal(signum: int, frame: Any) -> None:
            if self._signalled:
                logger.warning("worker %s: second signal, exiting at once", self.name)
                os._exit(ExitStatus.FORCED)
            self._signalled = True
            self.stop(f"got {signal.Signals(signum).name}")
            # Claimed but unstarted messages go back now, not after the grace.
            threading.Thread(target=self._release_held, name="dbqueue-release", daemon=True).start()

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[signum] = signal.signal(signum, on_signal)

    def _shutdown(self, consumers: list[threading.Thread]) -> ExitStatus:
        self._release_held()
        deadline = time.monotonic() + self.grace
        for thread in consumers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in consumers):
            with self._lock:
                running = [m.pk for m in self._running.values()]
            logger.warning("worker %s: grace period over with %s still running", self.name, running)
            return ExitStatus.ABANDONED
        return ExitStatus.OK

    def _release_held(self) -> None:
        with self._lock:
            unstarted = [m for held in self._held.values() for m in held]
            for held in self._held.values():
                held.clear()
        for message in unstarted:
            try:
                message.release()
            except DATABASE_TROUBLE as exc:  # its lease will expire instead
                logger.warning("could not release message %s: %s", message.pk, exc)
        if unstarted:
            logger.info("worker %s released %d unstarted message(s)", self.name, len(unstarted))
        connections.close_all()

    # --- consuming -------------------------------------------------------------

    def _consume(self) -> None:
        ident = threading.get_ident()
        held: deque[Message] = deque()
        # With batches, acks are written together when the batch is done: one
        # transaction instead of one per message. Their leases stay held until then.
        acking: list[tuple[Message, Verdict]] | None = [] if self.config.batch_size > 1 else None
        with self._lock:
            self._held[ident] = held
            self._acking[ident] = acking if acking is not None else []
        idle_for = 0.0
        try:
            while not self.stopping.is_set():
                try:
                    claimed = self._claim()
                except DATABASE_TROUBLE as exc:
                    self._database_trouble("claim", exc)
                    continue
                if not claimed:
                    if self._nothing_left():
                        self.stop("queues are empty")
                        break
                    idle_for = min(max(idle_for * 2, self.poll_interval), self.max_poll_interval)
                    self.wake.wait(idle_for)
                    self.wake.clear()
                    continue
                idle_for = 0.0
                with self._lock:
                    held.extend(claimed)
                while not self.stopping.is_set():
                    with self._lock:
                        if not held:
                            break
                        message = held.popleft()
                        self._running[ident] = message
                    try:
                        self._process(message, acking)
                    except Exception:  # a bug of ours must not stop the thread; the lease will expire
                        logger.exception("worker %s: could not process message %s", self.name, message.pk)
                    finally:
                        with self._lock:
                            self._running.pop(ident, None)
                self._flush(acking)
        finally:
            self._flush(acking)
            connections.close_all()

    def _claim(self) -> list[Message]:
        self._check_connection()
        queues = [q for q in self.queues if q not in self._paused_queues()]
        if not queues:
            return []
        limit = self.config.batch_size
        if self.config.max_messages:
            with self._lock:
                limit = min(limit, self.config.max_messages - self.processed - self.failed - self._in_hand())
            if limit <= 0:
                return []
        return Message.objects.claim(queues, limit, visibility_timeout=self.config.visibility_timeout, worker=self.name)

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

    def _in_hand(self) -> int:
        return sum(len(h) for h in self._held.values()) + len(self._running) + sum(map(len, self._acking.values()))

    def _nothing_left(self) -> bool:
        """True when this worker should stop for lack of work (--until-empty, --max-messages)."""
        if self.config.max_messages and self.processed + self.failed >= self.config.max_messages:
            self.stop("max messages reached")
            return True
        if not self.config.until_empty:
            return False
        with self._lock:
            if self._running or any(self._held.values()) or any(self._acking.values()):
                return False
        return not Message.objects.using(self.using).any_claimable(self.queues)

    def _paused_queues(self) -> set[str]:
        now = time.monotonic()
        if now - self._paused_read_at > PAUSED_REFRESH:
            self._paused = QueueState.objects.using(self.using).paused_names()
            self._paused_read_at = now
        return self._paused

    def _process(self, message: Message, acking: list[tuple[Message, Verdict]] | None = None) -> None:
        started = time.monotonic()
        verdict = decide(message, worker=self.name, handler=self.config.handler)
        if acking is not None and verdict.outcome == Outcome.ACKED:
            with self._lock:
                acking.append((message, verdict))
            outcome = "acked (written with its batch)"
        else:
            outcome = self._record(message, verdict)
            self._count(outcome in (Outcome.ACKED, Outcome.DEFERRED))
        logger.debug(
            "message %s (%s/%s) attempt %d: %s in %.3fs",
            message.pk,
            message.queue,
            message.kind,
            message.attempts,
            outcome,
            time.monotonic() - started,
        )

    def _count(self, ok: bool, number: int = 1) -> None:
        with self._lock:
            if ok:
                self.processed += number
            else:
                self.failed += number

    def _flush(self, acking: list[tuple[Message, Verdict]] | None) -> None:
        """Write the batch's acks in one transaction, waiting out a database outage."""
        if not acking:
            return
        with self._lock:
            batch = list(acking)
        messages = [message for message, _ in batch]
        results = {message.pk: verdict.result for message, verdict in batch}
        attempt = 0
        while True:
            try:
                held = ack_many(messages, worker=self.name, results=results)
                break
            except DATABASE_TROUBLE as exc:
                attempt += 1
                self._database_trouble(f"acknowledging {len(messages)} messages", exc, attempt)
        with self._lock:
            del acking[: len(batch)]
        for (_, verdict), ok in zip(batch, held, strict=True):
            verdict.written(Outcome.ACKED if ok else Outcome.LEASE_LOST)
        lost = [m.pk for m, ok in zip(messages, held, strict=True) if not ok]
        if lost:
            logger.warning("worker %s: leases lost before the ack of messages %s", self.name, lost)
        self._count(True, len(messages) - len(lost))
        self._count(False, len(lost))

    def _record(self, message: Message, verdict: Verdict) -> str:
        """Write the handler's outcome, waiting out a database outage.

        The handler has run; running it again because the database was away
        would be a needless duplicate. So the outcome is retried until it is
        written, or until a forced exit (then the lease expires and the
        message runs again: at least once).
        """
        attempt = 0
        while True:
            try:
                return verdict.record()
            except DATABASE_TROUBLE as exc:
                attempt += 1
                self._database_trouble(f"recording message {message.pk} as {verdict.outcome}", exc, attempt)
            except DbQueueError as exc:
                # The handler asked for something invalid (a naive Defer date, a
                # negative Retry delay): that is the handler's failure.
                logger.warning("message %s: handler's %s is invalid: %s", message.pk, verdict.outcome, exc)
                verdict = Verdict(Outcome.FAILED, partial(message.fail, exc))

    def _database_trouble(self, what: str, exc: Exception, attempt: int = 1) -> None:
        logger.warning("worker %s: %s failed (%s); retrying", self.name, what, str(exc).strip().splitlines()[0])
        connections[self.using].close()
        time.sleep(backoff(min(attempt + 3, 8), cap=5.0))

    # --- helpers ---------------------------------------------------------------

    def _held_leases(self) -> dict[tuple[str, float], list[int]]:
        """What this worker holds, as {(lease token, lease seconds): [ids]}."""
        with self._lock:
            messages = [m for h in self._held.values() for m in h] + list(self._running.values())
            messages += [m for acking in self._acking.values() for m, _ in acking]
        groups: dict[tuple[str, float], list[int]] = {}
        for message in messages:
            if message.lease_token:
                seconds = self.config.visibility_timeout or queue_options(message.queue).visibility_timeout
                groups.setdefault((message.lease_token, seconds), []).append(message.pk)
        return groups

    def _heartbeat(self) -> None:
        dbq = get_settings()
        last_log, last_counts = time.monotonic(), (0, 0)
        # Often enough that the shortest lease is renewed well before it runs out.
        leases = [self.config.visibility_timeout or queue_options(q).visibility_timeout for q in self.queues]
        interval = min(dbq.heartbeat_interval, min(leases) / 3)
        # Beats go on through the shutdown grace: running handlers keep their leases.
        while not self.finished.wait(interval):
            try:
                self._beat()
                elapsed = time.monotonic() - last_log
                if elapsed >= dbq.log_interval:
                    last_log, last_counts = time.monotonic(), self._log_summary(last_counts, elapsed)
            except DATABASE_TROUBLE as exc:
                logger.warning("worker %s: heartbeat failed (%s)", self.name, str(exc).strip().splitlines()[0])
                connections[self.using].close()
        connections.close_all()

    def _beat(self) -> None:
        """Say we are alive and keep the leases of everything we hold."""
        for (token, seconds), ids in self._held_leases().items():
            Message.objects.using(self.using).extend_leases(token, ids, seconds)
        if not WorkerRow.objects.using(self.using).beat(self.name, self.processed, self.failed):
            # the reaper took us for dead (a long pause); say we are back
            self._register()

    def _log_summary(self, last: tuple[int, int], interval: float) -> tuple[int, int]:
        counts = Message.objects.using(self.using).for_queue(self.queues).counts_by_queue()
        depth = {queue: c["ready"] + c["scheduled"] for queue, c in counts.items()}
        logger.info(
            "worker %s: %.1f messages/s, %d failed in the last %.0fs; depth %s",
            self.name,
            (self.processed - last[0]) / interval,
            self.failed - last[1],
            interval,
            depth,
        )
        return self.processed, self.failed

    def _register(self) -> None:
        WorkerRow.objects.using(self.using).register(
            self.name, self.queues, self.config.concurrency, self.processed, self.failed
        )

    def _unregister(self) -> None:
        try:
            WorkerRow.objects.using(self.using).unregister(self.name)
        except DATABASE_TROUBLE as exc:
            logger.warning("worker %s: could not remove its row (%s); the reaper will", self.name, exc)

    def _listen(self) -> None:
        """PostgreSQL: wake a consumer when a message lands in one of our queues."""
        queues = set(self.queues)
        while not self.stopping.is_set():
            try:
                for queue in notify.notifications(self.using, self.stopping.is_set):
                    if queue in queues:
                        self.wake.set()
            except ImportError:
                logger.warning("worker %s: LISTEN needs psycopg 3; polling instead", self.name)
                return
            except Exception as exc:  # the database restarting, say: polling still works
                logger.warning("worker %s: listener failed (%s); reconnecting", self.name, exc)
                self.stopping.wait(1.0)

    def _reap(self) -> None:
        from .reaper import Reaper

        reaper = Reaper(using=self.using)
        interval = get_settings().reap_interval
        while not self.stopping.wait(interval):
            try:
                report = reaper.run_once()
                if report and report.did_something:
                    logger.info("reaper: %s", report)
            except DATABASE_TROUBLE as exc:
                logger.warning("worker %s: reaper failed (%s)", self.name, exc)
                connections[self.using].close()
        connections.close_all()
