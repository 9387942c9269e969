"""The worker process: starts its threads, stops them, and says how it ended.

One `QueueWorker` is one ``runqueueworker`` process: ``concurrency``
consumer threads (`consumer`), a completer that writes their acks
(`completer`), a heartbeat (`heartbeat`), a
listener (`listener`: NOTIFY on PostgreSQL, nudges elsewhere), with ``--reap`` a reaper
(`django_dbqueue.reaper.Reaper.loop`). What they hold is in one
`Ledger`; the events they share and what a crash does are
in `Lifecycle`. When a served queue has an ``async def`` handler, an event
loop on a thread of its own runs them (`asyncloop`), fed by an
`AsyncConsumer` thread that claims for its free slots
(``--async-concurrency``); the consumer threads serve the other queues
(`split_queues`).

Shutdown: the first SIGTERM/SIGINT stops claiming, releases claimed but
unstarted messages at once and lets running handlers finish within
``SHUTDOWN_GRACE``; a second signal exits at once (those leases expire).
A thread that crashes stops the worker the same way, and it exits with
``ExitStatus.ERROR``.

A pool's child (``config.tether_fd``) also obeys its supervisor through a
`Tether`, and stops gracefully when the supervisor is gone.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import signal
import socket
import threading
import time
from typing import Any

import django
from django.db import connections

from .. import handlers as handler_registry
from .._version import __version__
from ..conf import describe_placement, get_settings, queue_options, queues_by_database
from ..console import event
from ..db import describe
from ..db.errors import DATABASE_TROUBLE
from ..exceptions import InvalidOption
from ..handlers import Handler, is_async
from ..models import Message
from ..reaper import Reaper
from ..schedules.scheduler import Scheduler
from ..validation import validate_queues
from .asyncconsumer import AsyncConsumer
from .asyncloop import EventLoop
from .completer import Completer
from .config import ExitStatus, WorkerConfig
from .consumer import Consumer, PausedQueues
from .heartbeat import Heartbeat
from .ledger import Ledger
from .lifecycle import Ending, Lifecycle
from .listener import Listener
from .recycling import Recycler
from .sizing import MAX_BATCH, BatchWatch
from .tether import Tether

logger = logging.getLogger("django_dbqueue")


def split_queues(queues: list[str], handler: Handler | None = None) -> tuple[list[str], list[str], list[str]]:
    """``queues`` as (async, sync, mixed) by their registered handlers (`QueueWorker.split_queues`).

    ``handler`` (exec mode) serves every queue from the threads.
    """
    if handler is not None:
        return [], list(queues), []
    kinds: dict[str, list[bool]] = {}
    for (queue, _), function in handler_registry.registered().items():
        kinds.setdefault(queue, []).append(is_async(function))
    asynchronous = [q for q in queues if kinds.get(q) and all(kinds[q])]
    mixed = [q for q in queues if any(kinds.get(q, ())) and not all(kinds[q])]
    return asynchronous, [q for q in queues if q not in asynchronous], mixed


class QueueWorker:
    """Runs handlers for messages of ``config.queues`` until told to stop."""

    def __init__(self, config: WorkerConfig) -> None:
        dbq = get_settings()
        self.config = config
        queues = config.queues or sorted({q for q, _ in handler_registry.registered()})
        if not queues:
            raise InvalidOption("no queues to serve: name them, or register handlers in an app's queues.py")
        self.queues = validate_queues(queues)
        groups = queues_by_database(self.queues)
        if len(groups) > 1:
            raise InvalidOption(
                f"these queues live on {len(groups)} databases ({describe_placement(groups)}) and one worker "
                f"process serves one: run a pool (--processes {len(groups)} or more, a child per database) "
                "or a worker per database"
            )
        self.using = next(iter(groups))
        self.poll_interval = config.poll_interval or dbq.poll_interval
        self.max_poll_interval = max(config.max_poll_interval or dbq.max_poll_interval, self.poll_interval)
        self.grace = dbq.shutdown_grace if config.grace is None else config.grace
        self.nudge_host = dbq.nudge_host
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        # Every worker takes part in firing the schedules of its database, unless told not to.
        self.scheduler = Scheduler(using=self.using) if config.schedules else None
        if self.scheduler is not None and not self.scheduler.schedules():
            self.scheduler = None
        self.ledger = Ledger()
        self.lifecycle = Lifecycle(self.name)
        self.heartbeat = Heartbeat(
            name=self.name,
            queues=self.queues,
            using=self.using,
            concurrency=config.concurrency,
            visibility_timeout=config.visibility_timeout,
            ledger=self.ledger,
            supervisor=config.supervisor,
        )
        self.tether = Tether(config.tether_fd, config.supervisor) if config.tether_fd is not None else None
        self.recycler: Recycler | None = None
        if self.tether is not None and (config.max_messages_per_child or config.max_memory_per_child):
            self.recycler = Recycler(
                self.tether, max_messages=config.max_messages_per_child, max_memory=config.max_memory_per_child
            )
        self.completer = Completer(name=self.name, using=self.using, ledger=self.ledger, lifecycle=self.lifecycle)
        self.async_queues, self.sync_queues, self.mixed_queues = self.split_queues()
        self.event_loop: EventLoop | None = None
        if self.async_queues or self.mixed_queues:
            self.event_loop = EventLoop(self.name, self.lifecycle, timeout=config.async_timeout)
        self._signalled: int | None = None  # the first SIGTERM/SIGINT, for the main loop to act on
        self._previous_handlers: dict[int, Any] = {}

    @property
    def processed(self) -> int:
        return self.ledger.counts().processed

    @property
    def failed(self) -> int:
        return self.ledger.counts().failed

    def split_queues(self) -> tuple[list[str], list[str], list[str]]:
        """The served queues as (async, sync, mixed): who claims which.

        A queue whose handlers are all ``async def`` is the async consumer's;
        any other (a sync handler, none, exec mode) the consumer threads'. A
        mixed queue (sync and async kinds) is the threads' too: its async
        kinds run on the loop while the thread that claimed them waits.
        """
        return split_queues(self.queues, self.config.handler)

    def consumer(self, slot: int, paused: PausedQueues | None = None) -> Consumer:
        """The consumer that runs in thread ``slot`` (one per --concurrency), over the queues of sync handlers."""
        return Consumer(slot, queues=self.sync_queues, **self._consumer_kwargs(paused))

    def async_consumer(self, slot: int, paused: PausedQueues | None = None) -> AsyncConsumer:
        """The thread that claims for the event loop, over the queues of async handlers."""
        assert self.event_loop is not None
        return AsyncConsumer(
            slot,
            queues=self.async_queues,
            concurrency=self.config.async_concurrency,
            **self._consumer_kwargs(paused),
        )

    def _consumer_kwargs(self, paused: PausedQueues | None) -> dict[str, Any]:
        return {
            "name": self.name,
            "served": self.queues,
            "using": self.using,
            "config": self.config,
            "poll_interval": self.poll_interval,
            "max_poll_interval": self.max_poll_interval,
            "ledger": self.ledger,
            "lifecycle": self.lifecycle,
            "paused": paused or PausedQueues(self.using),
            "completer": self.completer,
            "recycler": self.recycler,
            "event_loop": self.event_loop,
        }

    # --- lifecycle -----------------------------------------------------------

    def run(self) -> ExitStatus:
        """Start the threads, wait for a stop, shut down; returns the exit status."""
        started = time.monotonic()
        life = self.lifecycle
        self._install_signals()
        listener = Listener(name=self.name, queues=self.queues, using=self.using, nudge_host=self.nudge_host)
        self.heartbeat.nudge_address = listener.open()  # in the worker row, for producers to nudge
        self.heartbeat.register()
        paused = PausedQueues(self.using)
        consumers = []
        sync_consumers = {
            n: self.consumer(n, paused) for n in range(self.config.concurrency if self.sync_queues else 0)
        }
        for n, consumer in sync_consumers.items():
            consumers.append(life.thread(consumer.run, f"dbqueue-consumer-{n}"))
        if self.async_queues:
            slot = self.config.concurrency
            consumers.append(life.thread(self.async_consumer(slot, paused).run, "dbqueue-async-consumer"))
        completer = life.thread(self.completer.run, "dbqueue-completer")
        helpers = [completer, life.thread(lambda: self.heartbeat.run(life.finished), "dbqueue-heartbeat")]
        if self.event_loop is not None:
            helpers += self.event_loop.threads()
        if self.sync_queues and self.config.batch_size is None:  # adaptive batches: none waits behind a slow job
            watch = BatchWatch(self.ledger, name=self.name, using=self.using, consumers=sync_consumers)
            helpers.append(life.thread(lambda: watch.run(life.stopping), "dbqueue-batch-watch"))
        if listener.available():
            helpers.append(life.thread(lambda: listener.run(life.stopping, life.wake), "dbqueue-listener"))
        if self.config.reap:
            reaper = Reaper(using=self.using)
            helpers.append(life.thread(lambda: reaper.loop(life.stopping), "dbqueue-reaper"))
        if self.scheduler is not None:
            scheduler = self.scheduler
            helpers.append(life.thread(lambda: scheduler.loop(life.stopping), "dbqueue-scheduler"))
        tether = self.tether
        if tether is not None:
            helpers.append(life.thread(lambda: tether.run(life, self.stop_gracefully, self.exit_now), "dbqueue-tether"))
        self.log_banner()
        if tether is not None:
            tether.ready(self.name)  # before its thread may say that the worker leaves
        for thread in consumers + helpers:
            thread.start()
        while not life.stopping.wait(0.2):
            if self._signalled is not None:
                self.stop_gracefully(f"got {signal.Signals(self._signalled).name}")
                continue
            if self.config.max_runtime and time.monotonic() - started >= self.config.max_runtime:
                self.stop("max runtime reached", Ending.RECYCLE)
            if not any(t.is_alive() for t in consumers):
                self.stop("all consumer threads finished")
        status = self._shutdown(consumers)
        # The consumers that finished waited for their acks; a late one's are not taken (their leases expire),
        # and what the completer still retries is given up with the rest (finished).
        self.completer.close()
        life.finished.set()
        if self.event_loop is not None:
            self.event_loop.stop()
        for thread in helpers:
            thread.join(timeout=5)
        if life.crashed:
            status = ExitStatus.ERROR
        if self.ledger.is_empty():
            self.heartbeat.unregister()
        # Otherwise the worker still holds messages (handlers running past the grace, acks
        # never written): the row stays, its heartbeat goes silent, and the reaper gives
        # them back after WORKER_STALE_AFTER instead of a whole lease.
        waiting = self.waiting() if self.config.until_empty else None  # read before the connections close
        connections.close_all()
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self.log_summary(status, time.monotonic() - started, waiting)
        return status

    def handlers(self) -> dict[str, list[str]]:
        """What runs each queue's messages, for people: ``{queue: ["kind x: module.function", ...]}``."""
        if self.config.handler is not None:
            argv = getattr(self.config.handler, "argv", None)  # exec mode's command
            shown = f"exec: {shlex.join(argv)}" if argv else repr(self.config.handler)
            return {queue: [shown] for queue in self.queues}
        found: dict[str, list[str]] = {queue: [] for queue in self.queues}
        for (queue, kind), function in sorted(
            handler_registry.registered().items(), key=lambda i: (i[0][1] is None, i[0][1] or "")
        ):
            if queue in found:
                name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
                if handler_registry.is_atomic(queue, kind):
                    name += " (atomic)"
                found[queue].append(name if kind is None else f"kind {kind}: {name}")
        for queue, names in found.items():
            if not names:
                unhandled = queue_options(queue).unhandled
                names.append("no handler (messages are dead-lettered)" if unhandled == "dead" else "no handler (kept)")
        return found

    def batch_description(self) -> str:
        """--batch-size, or what the adaptive default claims."""
        size = self.config.batch_size
        return str(size) if size is not None else f"adaptive (1 to {MAX_BATCH})"

    def log_banner(self) -> None:
        """What this worker is and does, once at start (the console shows it at the default verbosity)."""
        database = describe(self.using)
        handlers = self.handlers()
        width = max(map(len, self.queues))
        queues = [f"{queue:<{width}}  {'; '.join(names)}" for queue, names in handlers.items()]
        schedules = "on" if self.scheduler is not None else ("off" if not self.config.schedules else "off (none)")
        reaper = "on" if self.config.reap else "off"
        lines = [
            f"django-dbqueue {__version__} worker {self.name} (Django {django.get_version()})",
            f"  database     {self.using} ({database})",
            f"  queues       {queues[0]}",
            *(f"               {line}" for line in queues[1:]),
            f"  concurrency  {self.config.concurrency}, batch size {self.batch_description()}, "
            f"schedules {schedules}, reaper {reaper}",
            *([f"  async        {self.async_description()}"] if self.event_loop is not None else []),
            *([f"  pool         a child of {self.config.supervisor}"] if self.config.supervisor else []),
            "  stop with CONTROL-C or SIGTERM (a second one stops at once)",
        ]
        fields = {
            "version": __version__,
            "worker": self.name,
            "database": self.using,
            "vendor": database,
            "queues": handlers,
            "concurrency": self.config.concurrency,
            "batch_size": self.config.batch_size or "adaptive",
            "schedules": self.scheduler is not None,
            "reaper": self.config.reap,
        }
        if self.event_loop is not None:
            fields["async_concurrency"] = self.config.async_concurrency
            fields["async_queues"] = self.async_queues
        if self.config.supervisor:
            fields["supervisor"] = self.config.supervisor
        logger.info("%s", "\n".join(lines), extra=event("banner", **fields))
        self.warn_mixed()

    def warn_mixed(self) -> None:
        """A queue with sync and async handlers: its async kinds run one per consumer thread, not on the loop's slots;
        and ``--async-timeout`` without an async handler, which limits nothing.

        Said once at start, as WARNINGs, because the docs' advice (a queue of
        their own) is easy to miss and the cost shows only under load.
        """
        if self.config.async_timeout is not None and self.event_loop is None:
            logger.warning(
                "worker %s: --async-timeout applies to async def handlers, and no queue it serves has one: "
                "its handlers run without a time limit",
                self.name,
                extra=event("async_timeout_unused", worker=self.name),
            )
        if not self.mixed_queues:
            return
        logger.warning(
            "worker %s: queue%s %s ha%s sync and async def handlers: a consumer thread claims each message and "
            "waits for an async one, so they run at most --concurrency (%d) at once, not --async-concurrency (%d); "
            'give the async handlers a queue of their own (docs/workers.md, "One event loop per process")',
            self.name,
            "s" if len(self.mixed_queues) > 1 else "",
            ", ".join(self.mixed_queues),
            "ve" if len(self.mixed_queues) > 1 else "s",
            self.config.concurrency,
            self.config.async_concurrency,
            extra=event("mixed_queues", worker=self.name, queues=self.mixed_queues),
        )

    def async_description(self) -> str:
        """The banner's line on the event loop: how many at once, over which queues."""
        timeout = f", timeout {self.config.async_timeout:g}s" if self.config.async_timeout else ""
        served = ", ".join(self.async_queues) or "none of its own (mixed queues' async kinds)"
        return f"{self.config.async_concurrency} at once on one event loop{timeout}; queues {served}"

    def log_summary(self, status: ExitStatus, elapsed: float, waiting: int | None = None) -> None:
        """One line on exit: how it ended and what it did, and what still waits when it ran until empty.

        ``acked`` counts the messages acknowledged (or deferred by their handler); ``failed`` the
        failed attempts not dead; ``processed`` all three together. ``waiting`` is `waiting()`, read
        by the caller while its connection is still open (None: not read, or the database could not say).
        """
        counts, dead = self.ledger.counts(), self.ledger.dead()
        failed = counts.failed - dead
        why = f": {self.lifecycle.why}" if self.lifecycle.why else ""
        fields = {
            "worker": self.name,
            "status": status.name,
            "reason": self.lifecycle.why,
            "processed": counts.total,
            "acked": counts.processed,
            "failed": failed,
            "dead": dead,
            "elapsed": round(elapsed, 3),
        }
        text = "worker %s exits (%s%s): %d acked, %d failed, %d dead in %.1fs"
        args: list[Any] = [self.name, status.name, why, counts.processed, failed, dead, elapsed]
        if waiting:
            fields["waiting"] = waiting
            text += "; %d left waiting (for a delay or a retry's backoff)"
            args.append(waiting)
        logger.info(text, *args, extra=event("summary", **fields))

    def waiting(self) -> int | None:
        """Messages of the served queues left unclaimed: scheduled for later, or due since the worker stopped.

        None when the database cannot say.
        """
        live = Message.objects.using(self.using).for_queue(self.queues)
        try:
            return live.scheduled().count() + live.ready().count()
        except DATABASE_TROUBLE:
            return None

    def stop(self, why: str, ending: Ending = Ending.STOP) -> None:
        """Stop claiming and shut down as a first signal would (callable from any thread)."""
        self.lifecycle.stop(why, ending)

    def stop_gracefully(self, why: str, ending: Ending = Ending.STOP) -> None:
        """What a first signal does: stop, and give the claimed but unstarted messages back now, not after the grace."""
        self.stop(why, ending)
        self.lifecycle.thread(self._release_unstarted, "dbqueue-release").start()

    def exit_now(self) -> None:
        """What a second signal does: exit at once; the leases of running messages will expire."""
        logger.warning("worker %s: told to exit at once", self.name)
        os._exit(ExitStatus.FORCED)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # tests run workers in threads; signals only reach the main thread

        def on_signal(signum: int, frame: Any) -> None:
            # It runs on the main thread between two bytecodes, maybe while that thread holds a lock it
            # would take: the main loop's own wait holds its Event's lock as it wakes, and setting that Event
            # here hung the worker for good. So it only notes the signal; the loop stops within 0.2 s.
            if self._signalled is not None:
                os.write(2, f"worker {self.name}: second signal, exiting at once\n".encode())
                os._exit(ExitStatus.FORCED)
            self._signalled = signum

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[signum] = signal.signal(signum, on_signal)

    def _shutdown(self, consumers: list[threading.Thread]) -> ExitStatus:
        self._release_unstarted()
        deadline = time.monotonic() + self.grace
        for thread in consumers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        # A claim that was under way when the stop came holds messages nobody will start.
        self._release_unstarted()
        if any(t.is_alive() for t in consumers):
            running = [m.pk for m in self.ledger.running()]
            logger.warning("worker %s: grace period over with %s still running", self.name, running)
            return ExitStatus.ABANDONED
        return ExitStatus.OK

    def _release_unstarted(self) -> None:
        unstarted = self.ledger.take_unstarted()
        for message in unstarted:
            try:
                message.release()
            except DATABASE_TROUBLE as exc:  # its lease will expire instead
                logger.warning("could not release message %s: %s", message.pk, exc)
        if unstarted:
            logger.info("worker %s released %d unstarted message(s)", self.name, len(unstarted))
        connections.close_all()
