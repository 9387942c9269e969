"""The async consumer: claims for the worker's event loop as many messages as it has free slots.

One thread, one connection, like a `Consumer`, for the queues whose
handlers are all ``async def``: it claims up to its free slots
(``--async-concurrency`` less what runs; within ``--max-messages``),
submits each message to the `EventLoop` as a task, and writes each outcome
as its task ends, acks through the completer in batches. No thread per
message: the thread only claims and writes; the handlers wait on the loop.

What it holds is in the worker's `Ledger`: claimed under its slot, each
running message under a key of its own, its acks in its slot's batch, so
the heartbeat extends their leases and a shutdown gives back what never
started, as for the threads. Stopping, it claims no more and waits for what
runs (within the grace: the worker's main thread stops waiting then).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any

from django.db import connections

from ..db.errors import DATABASE_TROUBLE
from ..handlers import find_handler
from ..models import Message
from ..running import Verdict
from .asyncloop import EventLoop
from .completer import ClaimAfter
from .consumer import Consumer
from .writing import GaveUp

logger = logging.getLogger("django_dbqueue")

SLICE = 0.05  # seconds: the longest it waits without looking at the worker's wake-up event and its stop
Done = tuple[tuple[int, int], Message, float, "concurrent.futures.Future[Verdict]"]


class AsyncConsumer(Consumer):
    """A `Consumer` whose messages run on ``event_loop``, ``concurrency`` at a time."""

    def __init__(self, slot: int, *, event_loop: EventLoop, concurrency: int, **kwargs: Any) -> None:
        super().__init__(slot, event_loop=event_loop, **kwargs)
        self.loop = event_loop
        self.concurrency = concurrency
        self._keys = itertools.count()
        self._done: deque[Done] = deque()  # appended on the loop's thread, taken on this one
        self._finished = threading.Event()
        self._in_flight = 0
        self._claim_after = 0.0  # monotonic time of the next claim when the last one found nothing

    def claim_after(self, batch: list[tuple[Message, Verdict]]) -> ClaimAfter | None:
        """None: this loop dispatches only what its own claims took, sized by its free slots."""
        return None

    def run(self) -> None:
        stopping = self.lifecycle.stopping
        idle_for = 0.0
        try:
            while True:
                self.collect()
                if stopping.is_set():
                    if not self._in_flight:
                        break
                    self.flush()
                    self._finished.wait(1.0)
                    self._finished.clear()
                    continue
                free = self.concurrency - self._in_flight
                woken = self.lifecycle.wake.is_set()
                if free > 0 and (woken or time.monotonic() >= self._claim_after):
                    self.lifecycle.wake.clear()
                    try:
                        claimed = self.claim(free)
                        if not claimed and not self._in_flight and self.settle():
                            continue  # acks were being written (a group's next message waits for them)
                        if not claimed and not self._in_flight and self.nothing_left():
                            break
                    except DATABASE_TROUBLE as exc:
                        self.writer.pause("claim", exc)
                        continue
                    if claimed:
                        idle_for, self._claim_after = 0.0, 0.0
                        self.dispatch()
                        continue  # room left: claim again at once
                    idle_for = min(max(idle_for * 2, self.poll_interval), self.max_poll_interval)
                    retry_in = getattr(claimed, "retry_in", None)  # a rate limit's next free slot
                    self._claim_after = time.monotonic() + (idle_for if retry_in is None else min(idle_for, retry_in))
                self.flush()
                if free > 0:
                    self.wait(self._claim_after - time.monotonic(), woken=True)
                else:
                    self.wait(1.0, woken=False)
        finally:
            try:
                self.flush()
                self.settle()
            finally:
                connections.close_all()

    def dispatch(self) -> None:
        """Start every claimed message of this slot as a task on the loop (a shutdown may have taken some back)."""
        while True:
            key = (self.slot, next(self._keys))
            message = self.ledger.start(self.slot, running_as=key)
            if message is None:
                return
            handler = self.config.handler or find_handler(message.queue, message.kind)
            if handler is None:  # unregistered since the worker started: the sync rules decide (unhandled)
                self.conclude(message, self.decide(message), time.monotonic(), key)
                continue
            started = time.monotonic()
            future = self.loop.submit(message, handler, self.name)
            self._in_flight += 1
            future.add_done_callback(partial(self._ended, key, message, started))

    def _ended(
        self, key: tuple[int, int], message: Message, started: float, future: concurrent.futures.Future[Verdict]
    ) -> None:
        """A task ended (called on the loop's thread): its outcome is written on this one."""
        self._done.append((key, message, started, future))
        self._finished.set()

    def collect(self) -> None:
        """Write the outcome of every task that ended since the last call."""
        while self._done:
            key, message, started, future = self._done.popleft()
            self._in_flight -= 1
            try:
                self.conclude(message, future.result(), started, key)
            except GaveUp as exc:
                logger.warning("worker %s: message %s not recorded (%s)", self.name, message.pk, exc)
                self.ledger.finish(key)
            except BaseException:  # a bug of ours, or the task was abandoned: the lease will expire
                logger.exception("worker %s: could not process message %s", self.name, message.pk)
                self.ledger.finish(key)
            if self.recycler is not None:
                self.recycler.check(self.ledger)

    def wait(self, seconds: float, *, woken: bool) -> None:
        """Until a task ends, the worker is stopped (or woken, if ``woken``: it has room), or ``seconds`` pass."""
        deadline = time.monotonic() + max(0.0, seconds)
        wake, stopping = self.lifecycle.wake, self.lifecycle.stopping
        while not (self._finished.is_set() or (woken and wake.is_set()) or stopping.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._finished.wait(min(left, SLICE))
        self._finished.clear()
