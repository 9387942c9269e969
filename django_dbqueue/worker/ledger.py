"""The in-flight ledger: what a worker holds, in one place, behind one lock.

A worker holds a message from its claim until its outcome is written. In
between, the message is in exactly one of three places, kept per slot (a
consumer thread's own key):

- **claimed**, not started (`Ledger.claimed`, then `start`),
  given back at once on a graceful stop (`take_unstarted`), or when the
  message before them runs long (`take_behind_long`);
- **running**, at most one per slot, until `finish` (its outcome
  written) or `await_ack`;
- **waiting for its ack**, written with the rest of its batch in one
  transaction (`unacked`, then `acked`).

A claim itself is in the ledger from before it starts until its messages
are handed over (`claiming`): its rows are leased as soon as
its transaction commits, a moment before `claimed`, so in
between the worker must not be taken for idle. ``--until-empty`` decides
that the queues are empty with the ledger closed
(`close_if_empty`): nothing held, nothing being claimed, and
no claim may start until it is reopened.

The heartbeat extends the leases of all three (`leases`);
``--max-messages`` reads how much is in hand; the processed and failed
counters feed the worker row and the log.

Lock contract: every method takes the ledger's lock itself and calls
nothing outside while holding it, so callers hold no lock of their own.
Only a slot's consumer moves that slot's messages, with one exception:
the completer adds to a slot's claimed ones what a claim in that slot's
acks' transaction took, while those acks are still in hand (so the worker
is never empty in between). Other threads read (the heartbeat, the main
thread) or take the unstarted ones back (shutdown, the batch watch).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ..models import Message


class Counts(NamedTuple):
    """Outcomes written so far: acknowledged or deferred, and everything else."""

    processed: int
    failed: int

    @property
    def total(self) -> int:
        return self.processed + self.failed


class Ledger:
    """Everything a worker holds, per slot, and its counters; safe to share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed: dict[Hashable, deque[Message]] = {}
        self._running: dict[Hashable, Message] = {}
        self._started: dict[Hashable, float] = {}  # when each running message started (time.monotonic())
        self._unacked: dict[Hashable, list[tuple[Message, Any]]] = {}
        self._claiming: set[Hashable] = set()
        self._closed = False
        self._processed = 0
        self._failed = 0
        self._dead = 0

    # --- a slot's consumer moves its messages --------------------------------------

    @contextlib.contextmanager
    def claiming(self, slot: Hashable) -> Iterator[bool]:
        """Around one claim of ``slot``: yields whether it may claim (False while the ledger is closed).

        Until the block ends, the worker counts as holding something
        (`is_empty` is False): call `claimed` inside it.
        """
        with self._lock:
            allowed = not self._closed
            if allowed:
                self._claiming.add(slot)
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._claiming.discard(slot)

    def claimed(self, slot: Hashable, messages: Iterable[Message]) -> None:
        """``slot`` claimed ``messages``: held, not started, in the order given."""
        with self._lock:
            self._claimed.setdefault(slot, deque()).extend(messages)

    def unstarted(self, slot: Hashable) -> int:
        """How many messages ``slot`` claimed and has not started."""
        with self._lock:
            return len(self._claimed.get(slot, ()))

    def start(self, slot: Hashable, *, running_as: Hashable | None = None) -> Message | None:
        """The next claimed message of ``slot``, now running; None when it has none left.

        ``running_as``: the key it runs under instead of ``slot`` (the async
        consumer runs many at once, each under a key of its own; pass that
        key to `finish` and `await_ack`).
        """
        key = slot if running_as is None else running_as
        with self._lock:
            if key in self._running:
                raise RuntimeError(f"slot {key!r} already runs message {self._running[key].pk}")
            held = self._claimed.get(slot)
            if not held:
                return None
            message = self._running[key] = held.popleft()
            self._started[key] = time.monotonic()
            return message

    def finish(self, slot: Hashable, ok: bool | None = None, *, dead: bool = False) -> Message | None:
        """``slot``'s running message is done with: its outcome is written, or will never be.

        ``ok`` counts it: True as processed, False as failed (``dead``: and
        dead-lettered), None not at all (nothing was written; its lease will
        expire). Returns the message, or None when the slot runs nothing
        (already finished, or waiting for its ack).
        """
        with self._lock:
            message = self._running.pop(slot, None)
            self._started.pop(slot, None)
            if message is not None and ok is not None:
                self._count(ok, 1)
                if not ok and dead:
                    self._dead += 1
            return message

    def await_ack(self, slot: Hashable, note: Any = None, *, batch: Hashable | None = None) -> None:
        """``slot``'s running message succeeded; its ack waits to be written with the batch.

        ``note`` travels with it to `unacked` (the worker keeps the verdict
        there); ``batch``: the slot whose batch it joins, when it ran under a
        key of its own (`start`'s ``running_as``).
        """
        with self._lock:
            message = self._running.pop(slot, None)
            self._started.pop(slot, None)
            if message is None:
                raise RuntimeError(f"slot {slot!r} runs no message")
            self._unacked.setdefault(slot if batch is None else batch, []).append((message, note))

    def unacked(self, slot: Hashable) -> list[tuple[Message, Any]]:
        """The messages of ``slot`` waiting for their ack, oldest first, with their notes (a copy)."""
        with self._lock:
            return list(self._unacked.get(slot, ()))

    def acked(self, slot: Hashable, held: Sequence[bool | None]) -> None:
        """The first ``len(held)`` unacked messages of ``slot`` were written.

        ``held[i]`` says whether the i-th ack found its lease: counted as
        processed if so, as failed if not (its lease was lost) or if that
        cannot be known (None: an ack unknown).
        """
        with self._lock:
            waiting = self._unacked.get(slot, [])
            if len(held) > len(waiting):
                raise RuntimeError(f"slot {slot!r} has {len(waiting)} unacked message(s), not {len(held)}")
            del waiting[: len(held)]
            kept = sum(map(bool, held))
            self._count(True, kept)
            self._count(False, len(held) - kept)

    # --- anyone reads, or takes the unstarted back -----------------------------------

    def take_unstarted(self) -> list[Message]:
        """Every claimed, unstarted message of every slot, now no longer held (to be given back)."""
        with self._lock:
            taken = [message for held in self._claimed.values() for message in held]
            for held in self._claimed.values():
                held.clear()
            return taken

    def take_behind_long(self, longer_than: float) -> list[Message]:
        """The unstarted messages of each slot whose running message started over ``longer_than`` seconds ago,
        now no longer held (to be given back: they would wait behind it)."""
        now = time.monotonic()
        taken: list[Message] = []
        with self._lock:
            for slot, held in self._claimed.items():
                if held and slot in self._running and now - self._started[slot] > longer_than:
                    taken += held
                    held.clear()
        return taken

    def running_longer_than(self, seconds: float) -> list[Hashable]:
        """The slots whose running message started over ``seconds`` ago."""
        now = time.monotonic()
        with self._lock:
            return [slot for slot in self._running if now - self._started[slot] > seconds]

    def leases(self) -> list[Message]:
        """Every message whose lease the worker holds: claimed, running or waiting for its ack."""
        with self._lock:
            messages = [message for held in self._claimed.values() for message in held]
            messages += self._running.values()
            messages += [message for waiting in self._unacked.values() for message, _ in waiting]
            return messages

    def running(self) -> list[Message]:
        """The messages whose handlers run now."""
        with self._lock:
            return list(self._running.values())

    def in_hand(self) -> int:
        """How many messages the worker holds (claimed, running or waiting for its ack)."""
        with self._lock:
            return self._in_hand()

    def is_empty(self) -> bool:
        """Whether the worker holds nothing at all, and no claim is under way."""
        with self._lock:
            return not self._claiming and self._in_hand() == 0

    def close_if_empty(self) -> bool:
        """Close the ledger if it is empty (see `is_empty`): no claim may start until `reopen`.

        False if it holds something, a claim is under way, or it is closed already.
        """
        with self._lock:
            if self._closed or self._claiming or self._in_hand():
                return False
            self._closed = True
            return True

    def reopen(self) -> None:
        """Let claims start again after `close_if_empty`."""
        with self._lock:
            self._closed = False

    def room(self, wanted: int, limit: int | None) -> int:
        """How many of ``wanted`` may be claimed without passing ``limit`` messages in all (done and in hand)."""
        if limit is None:
            return wanted
        with self._lock:
            return max(0, min(wanted, limit - self._processed - self._failed - self._in_hand()))

    def counts(self) -> Counts:
        with self._lock:
            return Counts(self._processed, self._failed)

    def handled(self) -> int:
        """Messages whose handlers have run: outcomes written, and acks waiting to be written with their batch."""
        with self._lock:
            return self._processed + self._failed + sum(map(len, self._unacked.values()))

    def dead(self) -> int:
        """How many of the failed were dead-lettered (for the worker's summary)."""
        with self._lock:
            return self._dead

    # --- under the lock ----------------------------------------------------------------

    def _in_hand(self) -> int:
        held = sum(map(len, self._claimed.values()))
        return held + len(self._running) + sum(map(len, self._unacked.values()))

    def _count(self, ok: bool, number: int) -> None:
        if ok:
            self._processed += number
        else:
            self._failed += number
