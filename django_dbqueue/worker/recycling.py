"""A pool child's limits (``--max-messages-per-child``, ``--max-memory-per-child``), checked between messages.

Past a limit the child does not stop at once: it asks its supervisor for a
replacement (`Tether.recycle`) and goes on working until the
replacement is ready and the supervisor tells it to stop, so the pool's
capacity does not drop while a new process starts. Then it stops as after
a signal: its running handlers finish, its unstarted messages go back. A
child whose supervisor does not answer stops by itself after
``tether.RECYCLE_WAIT`` seconds.
"""

from __future__ import annotations

import threading

from .ledger import Ledger
from .memory import resident_megabytes
from .tether import Tether


class Recycler:
    """Checks a child's limits after each message; asks for its replacement once, at the first one passed."""

    def __init__(self, tether: Tether, *, max_messages: int | None, max_memory: float | None) -> None:
        self.tether = tether
        self.max_messages = max_messages
        self.max_memory = max_memory  # megabytes
        self._lock = threading.Lock()
        self._asked = False

    def check(self, ledger: Ledger) -> None:
        """Called by each consumer between messages (cheap: a counter, and one small read on Linux)."""
        if self._asked:
            return
        # Handled, not only written: a batch's acks are written when it ends, after its last check.
        why = self.passed(ledger.handled())
        if why is None:
            return
        with self._lock:
            if self._asked:
                return
            self._asked = True
        self.tether.recycle(why)

    def passed(self, messages: int) -> str | None:
        """Which limit this child has passed, in words; None while it is within them."""
        if self.max_messages is not None and messages >= self.max_messages:
            return f"{messages} messages, at its limit of {self.max_messages}"
        if self.max_memory is not None:
            resident = resident_megabytes()
            if resident > self.max_memory:
                return f"resident memory {resident:.0f} MB, past its limit of {self.max_memory:g} MB"
        return None
