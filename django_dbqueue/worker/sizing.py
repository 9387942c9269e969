"""How many messages a consumer claims at a time when no ``--batch-size`` is given: adaptive claiming.

One message per claim costs a claim's commit per message; a batch of
twenty costs one per twenty, but the messages behind the first wait for
it, and are held by this worker if it dies. So the batch follows the
handlers: a consumer keeps a moving average of how long its handlers
take, and claims as many as fit in `BATCH_BUDGET` seconds of work, at
least one and at most `MAX_BATCH`. Floods of short jobs go in batches;
slow jobs one at a time, as with ``--batch-size 1``. A consumer starts at
one message, before it has seen a handler run.

Two rules keep batches from costing what a batch of one never did
(docs/workers.md, "Adaptive claiming"):

- a handler that runs past `LONG_HANDLER` seconds gives its unstarted
  batch-mates back at once (`BatchWatch`), keeping their place in the
  queue and their attempt, and the acks of those that ran before it are
  written then, not when it ends: nothing waits behind a slow job;
- a message on its last attempt is never kept as a batch-mate
  (`Consumer.claim` gives it back at once, and it comes first in the next
  claim): a worker that is killed cannot dead-letter it without having
  run it (one the database refuses to take back stays in the batch).
  Queues with ``MAX_ATTEMPTS`` 1, all of whose messages are on their last
  attempt, are claimed one at a time for the same reason, and so are
  rate-limited queues: a message given back has used a rate slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from django.db import connections

from ..db.errors import DATABASE_TROUBLE
from ..models import Message
from .ledger import Ledger

logger = logging.getLogger("django_dbqueue")

BATCH_BUDGET = 0.1  # seconds of expected work one claim may take: how long its last message may wait
MAX_BATCH = 20  # however short the handlers: what one consumer holds unstarted, and what a SIGKILL can strand
LONG_HANDLER = 0.25  # seconds: a handler running this long gives its unstarted batch-mates back
SMOOTHING = 0.3  # weight of the newest duration in the moving average


class ClaimSizer:
    """One consumer's claim size: ``fixed`` (``--batch-size``), else sized by its handlers' recent durations."""

    def __init__(self, fixed: int | None, *, one_at_a_time: bool = False) -> None:
        self.fixed = fixed
        # Queues whose messages have a single attempt (a batch-mate stranded by a SIGKILL would die unrun),
        # or a rate limit (a batch-mate given back has used a rate slot for nothing).
        self.one_at_a_time = one_at_a_time
        self.average: float | None = None  # seconds per handler, None until one ran

    @property
    def adaptive(self) -> bool:
        return self.fixed is None

    def size(self) -> int:
        """How many to claim next."""
        if self.fixed is not None:
            return self.fixed
        if self.one_at_a_time or self.average is None:
            return 1
        return max(1, min(MAX_BATCH, int(BATCH_BUDGET / max(self.average, 1e-6))))

    def ran(self, seconds: float) -> None:
        """A handler of this consumer took ``seconds``."""
        if self.average is None:
            self.average = seconds
        else:
            self.average += SMOOTHING * (seconds - self.average)


def stays_in_batch(message: Message) -> bool:
    """Whether a claimed message may wait behind another: not on its last attempt."""
    return message.attempts_left()


def give_back(messages: Iterable[Message], worker: str, why: str) -> list[Message]:
    """Give claimed, unstarted ``messages`` back (their place and their attempt kept); the ones that could
    not be, because the database is away (logged): the caller keeps them, or their leases run out."""
    kept = []
    for message in messages:
        try:
            message.release()
        except DATABASE_TROUBLE as exc:
            logger.warning("worker %s: could not give message %s back (%s): %s", worker, message.pk, why, exc)
            kept.append(message)
    return kept


class EarlyAcks(Protocol):
    """A consumer, as the watch sees it: it can hand over its waiting acks while its handler runs."""

    def flush_early(self) -> None: ...


class BatchWatch:
    """Gives back the unstarted batch-mates of handlers that run past `LONG_HANDLER` seconds.

    A thread of the worker's own, with its own connection, that looks at
    the ledger a few times a second: the consumer that runs the long
    handler is busy with it.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        name: str,
        using: str,
        consumers: Mapping[Any, EarlyAcks] | None = None,  # by slot
        longer_than: float = LONG_HANDLER,
    ) -> None:
        self.ledger = ledger
        self.name = name
        self.using = using
        self.consumers = consumers or {}
        self.longer_than = longer_than

    def run(self, finished: threading.Event) -> None:
        try:
            while not finished.wait(self.longer_than / 3):
                self.check()
        finally:
            connections.close_all()

    def check(self) -> int:
        """One look: give back what waits behind a long handler now, and have the acks of what ran before it
        in its batch written; how many were given back."""
        given = 0
        # As a claim does: until they are given back, the worker holds them, and --until-empty waits.
        with self.ledger.claiming(self) as allowed:
            behind = self.ledger.take_behind_long(self.longer_than) if allowed else []
            if behind:
                # One not given back keeps its lease until it runs out; it cannot go back in the batch,
                # which may have ended meanwhile. It never ran, and is never on its last attempt.
                given = len(behind) - len(give_back(behind, self.name, "its batch-mate runs long"))
                logger.info(
                    "worker %s gave back %d message(s) waiting behind a handler running over %gs",
                    self.name,
                    given,
                    self.longer_than,
                )
        for slot in self.ledger.running_longer_than(self.longer_than):
            consumer = self.consumers.get(slot)
            if consumer is not None:
                consumer.flush_early()
        return given
