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
from contextlib import contextmanager, suppress
from typing import Any

# The exit status of a second signal: the loop was not waited for.
FORCED_EXIT = 4


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """The event SIGTERM/SIGINT set while the block runs; the previous handlers come back after it.

    The handler runs on the main thread between two bytecodes, maybe while
    that thread holds the event's own lock (waiting on it, as it wakes): it
    never takes that lock itself. A helper thread sets the event, woken
    through a pipe the handler writes to.
    """
    stop = threading.Event()
    read_end, write_end = os.pipe()
    signalled: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if signalled:
            os._exit(FORCED_EXIT)
        signalled.append(signum)
        os.write(write_end, b"!")

    def relay() -> None:
        try:
            if os.read(read_end, 1) == b"!":
                stop.set()
        finally:
            os.close(read_end)

    threading.Thread(target=relay, name="dbqueue-signals", daemon=True).start()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with suppress(OSError):  # a relay that passed a signal on has ended already
            os.write(write_end, b".")  # the relay ends
        os.close(write_end)
