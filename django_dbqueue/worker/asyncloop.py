"""The event loop of a worker's ``async def`` handlers: one per process, on a thread of its own.

A worker starts it only when a served queue has an async handler
(docs/workers.md, "Async handlers"). One loop per process, not per consumer
thread: a loop holds hundreds of handlers waiting on I/O at the cost of a
task each, so one is enough, and the `AsyncConsumer` feeding it claims as
many messages as it has free slots (``--async-concurrency``).

Each message runs as a task (`run`, `submit`): `running.adecide` decides
its outcome; the consumer thread that submitted it writes that outcome, as
for a sync handler. On the loop, a watcher (every `WATCH_EVERY` seconds):

- cancels the task of a message whose cancel was asked (the heartbeat sets
  the flag): ``asyncio`` cancellation at the handler's next ``await``;
- ticks, so the loop's watchdog thread notices a handler that blocks the
  loop (`BLOCKED_AFTER` seconds without a tick) and logs a warning naming
  the message whose task holds it.

Connections: Django's async ORM methods (``aget``, ``acreate``...) run
through ``sync_to_async`` on asgiref's one thread for thread-sensitive code,
and use that thread's connection, not the worker's own. When a message's
task ends, ``close_old_connections()`` runs there, as Django runs it when
a request ends under ASGI (`_close_old_connections`): a broken connection
is closed, and one older than ``CONN_MAX_AGE`` (0 by default: every one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from ..running import Verdict, adecide
from .lifecycle import Lifecycle

if TYPE_CHECKING:
    from ..handlers import Handler
    from ..models import Message

logger = logging.getLogger("django_dbqueue")

WATCH_EVERY = 0.1  # seconds between the watcher's passes on the loop (cancel requests, the tick)
BLOCKED_AFTER = 1.0  # seconds without a tick before the watchdog says a handler blocks the loop


class EventLoop:
    """An asyncio loop on the thread `run_forever` runs on, with its watchdog; ``timeout``: --async-timeout."""

    def __init__(self, name: str, lifecycle: Lifecycle, *, timeout: float | None = None) -> None:
        self.name = name
        self.lifecycle = lifecycle
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()  # its thread runs it (`threads`); closed when that ends
        self._tasks: dict[asyncio.Task[Verdict], Message] = {}  # touched on the loop's thread only
        self._cancelled: set[asyncio.Task[Verdict]] = set()
        self._tick = time.monotonic()
        self._started = threading.Event()

    # --- threads -----------------------------------------------------------------------

    def threads(self) -> list[threading.Thread]:
        """The loop's thread and its watchdog's (not started); a crash of either stops the worker."""
        return [
            self.lifecycle.thread(self.run_forever, "dbqueue-event-loop"),
            self.lifecycle.thread(self.watchdog, "dbqueue-loop-watchdog"),
        ]

    def run_forever(self) -> None:
        asyncio.set_event_loop(self.loop)
        watcher = self.loop.create_task(self._watch(), name="dbqueue-loop-watcher")
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            watcher.cancel()
            if not self._tasks:  # handlers still running were abandoned with the process: leave them be
                self.loop.run_until_complete(asyncio.gather(watcher, return_exceptions=True))
                self.loop.close()

    def stop(self) -> None:
        """Stop the loop once its thread has started it (callable from any thread)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)

    def watchdog(self) -> None:
        """Warn once per stall when the loop has not ticked for `BLOCKED_AFTER` seconds, until finished."""
        stalled_since: float | None = None
        finished = self.lifecycle.finished
        while not finished.wait(BLOCKED_AFTER / 4):
            if not self._started.is_set():
                continue
            lag = time.monotonic() - self._tick - WATCH_EVERY
            if lag < BLOCKED_AFTER:
                if stalled_since is not None:
                    logger.warning("worker %s: the event loop runs again after %.1fs blocked", self.name, lag)
                    stalled_since = None
                continue
            if stalled_since is None:
                stalled_since = self._tick
                logger.warning(
                    "worker %s: the event loop has been blocked for %.1fs by %s; an async handler must not "
                    "block (run blocking calls with asyncio.to_thread or sync_to_async); meanwhile no other "
                    "async handler runs, and cancel requests and --async-timeout wait",
                    self.name,
                    lag,
                    self.blocker(),
                )

    def blocker(self) -> str:
        """What the loop runs now, for the watchdog's warning (read from another thread: a best guess)."""
        try:
            task = asyncio.current_task(self.loop)
        except RuntimeError:
            task = None
        message = self._tasks.get(task) if task is not None else None
        if message is None:
            return "code outside any handler" if task is None else f"task {task.get_name()}"
        what = f"{message.queue}/{message.kind}" if message.kind else message.queue
        return f"the handler of message {message.pk} ({what})"

    # --- running messages ----------------------------------------------------------------

    def submit(self, message: Message, handler: Handler, worker: str) -> concurrent.futures.Future[Verdict]:
        """Run ``message`` through ``handler`` on the loop (from another thread); its verdict comes in the future."""
        return asyncio.run_coroutine_threadsafe(self.run(message, handler, worker), self.loop)

    async def run(self, message: Message, handler: Handler, worker: str) -> Verdict:
        """One message's task: its verdict; the async ORM's old connections closed when it ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = message
        try:
            return await adecide(message, worker=worker, handler=handler, timeout=self.timeout)
        finally:
            del self._tasks[task]
            self._cancelled.discard(task)
            await _close_old_connections()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY)
            self._tick = time.monotonic()
            for task, message in list(self._tasks.items()):
                if task not in self._cancelled and message.cancel_requested():
                    self._cancelled.add(task)
                    task.cancel(f"message {message.pk}: cancel was asked")

    def in_flight(self) -> int:
        return len(self._tasks)


@sync_to_async
def _close_old_connections() -> None:
    """Django's end-of-request hygiene, where the handler's ORM calls ran (none: nothing to do).

    In the task's context on asgiref's thread: it sees the connections the
    async ORM used, never the worker's own.
    """
    close_old_connections()
