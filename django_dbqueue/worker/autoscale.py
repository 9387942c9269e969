"""Autoscaling a pool (``runqueueworker --autoscale MIN,MAX``; docs/workers.md, "Autoscaling").

The pool grows and shrinks by child processes, not threads: a process adds
a core's worth of Python for CPU-bound handlers as well as room for
I/O-bound ones, and every child keeps its ``--concurrency`` threads, so
each step is one child's capacity, predictable in connections and memory.

Each reading comes from the database (`Reading`): per served queue, the
seconds the message a claim would take next has waited
(`MessageQuerySet.next_waits`: one index read per queue), and how many
messages the pool's children hold. `Autoscaler.decide` turns readings
into decisions, with hysteresis:

- **grow** by one child when a queue's next message has waited at least
  ``AUTOSCALE_WAIT`` seconds, the pool is below MAX, and no child is still
  starting (the last one grown has not begun to claim yet);
- **shrink** by one child once, for ``AUTOSCALE_IDLE`` seconds in a row,
  no message waited that long and the children held no more than all but
  one of them can run (one child's capacity unused); the idle clock starts
  again after each step, and after any growth.

`Autoscaler` reads no clock and no database of its own: the supervisor
feeds it, and tests drive it with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """The pool's backlog at one moment."""

    waits: dict[str, float | None]  # queue -> seconds its next message has waited (None: nothing claimable)
    held: int  # messages the pool's children hold (claimed, running, waiting for their ack)

    def longest(self) -> tuple[str, float] | None:
        """The queue whose next message has waited longest, and how long."""
        waiting = [(wait, queue) for queue, wait in self.waits.items() if wait is not None]
        if not waiting:
            return None
        wait, queue = max(waiting)
        return queue, wait


class Autoscaler:
    """Decides the size of a pool between ``low`` and ``high`` children from its `Reading`s."""

    def __init__(self, low: int, high: int, *, wait: float, idle: float) -> None:
        self.low, self.high = low, high
        self.wait = wait  # seconds a next message may wait before the pool grows
        self.idle = idle  # seconds of one child's capacity unused before the pool shrinks
        self._idle_since: float | None = None

    def decide(
        self, reading: Reading, *, size: int, starting: int, per_child: int, now: float
    ) -> tuple[int, str] | None:
        """The size the pool should have now and why, or None to keep it.

        ``size``: the children serving now (starting ones included);
        ``starting``: of them, those not ready yet; ``per_child``: the
        messages one child holds when busy (its threads times its batch).
        """
        longest = reading.longest()
        backlog = longest is not None and longest[1] >= self.wait
        if backlog and longest is not None:
            self._idle_since = None
            if size < self.high and not starting:
                queue, wait = longest
                return size + 1, f"grew to {size + 1}: the next message of {queue} has waited {wait:.1f}s"
            return None
        if size <= self.low or reading.held > (size - 1) * per_child:
            self._idle_since = None
            return None
        if self._idle_since is None:
            self._idle_since = now
            return None
        if now - self._idle_since < self.idle:
            return None
        self._idle_since = now  # one child per idle period
        return size - 1, f"shrank to {size - 1}: one child's capacity unused for {self.idle:g}s"

    def resized(self, low: int, high: int) -> None:
        """New bounds (SIGTTIN and SIGTTOU move them to make room)."""
        self.low, self.high = low, high
        self._idle_since = None
