"""How the long-running commands stop: SIGTERM or SIGINT sets an event the loop checks.

A signal handler that only sets an event cannot interrupt a database call or
a ``finally`` half-way (a KeyboardInterrupt raised there could leave a lock
held or a process hanging); a second signal exits at once, for the operator
who means it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The exit status of a second signal: the loop was not waited for.
FORCED_EXIT = 4


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """The event SIGTERM/SIGINT set while the block runs; the previous handlers come back after it."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            os._exit(FORCED_EXIT)
        stop.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
