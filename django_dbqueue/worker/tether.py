"""A pool child's line to its supervisor (docs/workers.md, "A pool of processes").

The supervisor starts each child with one end of a socket pair and keeps
the other. Over it, in lines of text:

- the supervisor says ``stop`` (stop gracefully, as a first SIGTERM would)
  or ``now`` (exit at once, as a second one would);
- the child says ``ready NAME`` once it has registered its row and started
  its threads, ``recycle WHY`` when it passed one of its limits
  (`recycling`: it goes on working until its replacement is ready and the
  supervisor says ``stop``, or for ``RECYCLE_WAIT`` seconds at most), and
  ``leaving ENDING WHY`` as soon as it starts to stop for a reason of its
  own (`Ending`).

The end of the socket is how a child learns that its supervisor is gone
(killed with SIGKILL, say): the kernel closes the supervisor's end, the
child reads end-of-file and stops gracefully, so a pool leaves no orphans.
A socket rather than signals, because a supervisor that relays SIGTERM to
its children would make it a second signal for the children that got the
first one too (systemd's default KillMode sends it to every process).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from .lifecycle import Ending, Lifecycle

logger = logging.getLogger("django_dbqueue")

POLL = 0.2  # seconds between looks at the worker's own stop, while the socket is quiet
# Seconds a child past its limits waits for the supervisor to stop it (its replacement ready) before
# it stops by itself: longer than a replacement takes to start on a busy machine, bounded all the same.
RECYCLE_WAIT = 180.0
STOP, NOW = "stop", "now"


class Tether:
    """The child's end of the socket pair its supervisor passed it as file descriptor ``fd``."""

    def __init__(self, fd: int, supervisor: str) -> None:
        self.socket = socket.socket(fileno=fd)
        self.supervisor = supervisor
        self._lock = threading.Lock()
        self._told = False
        self._recycle: tuple[float, str] | None = None  # when it asked for its replacement, and why

    def send(self, line: str) -> None:
        """One line to the supervisor; a supervisor that is gone is noticed by `run`, not here."""
        with self._lock, contextlib.suppress(OSError):
            self.socket.sendall(f"{line}\n".encode())

    def ready(self, name: str) -> None:
        self.send(f"ready {name}")

    def recycle(self, why: str) -> None:
        """Ask the supervisor for a replacement (once); the worker goes on until it is told to stop."""
        with self._lock:
            if self._recycle is not None:
                return
            self._recycle = (time.monotonic(), why)
        self.send(f"recycle {why}")

    def run(self, lifecycle: Lifecycle, stop: Callable[[str, Ending], None], exit_now: Callable[[], None]) -> None:
        """Until the worker has finished: obey the supervisor, and tell it when the worker stops on its own.

        ``stop(why, ending)`` stops the worker gracefully; ``exit_now()`` does not return.
        """
        pending = b""
        try:
            while not lifecycle.finished.is_set():
                self._tell_leaving(lifecycle)
                asked = self._recycle
                if asked is not None and time.monotonic() - asked[0] > RECYCLE_WAIT:
                    logger.warning("worker %s: no replacement after %gs; it stops", lifecycle.name, RECYCLE_WAIT)
                    stop(asked[1], Ending.RECYCLE)
                    self._recycle = None
                readable, _, _ = select.select([self.socket], [], [], POLL)
                if not readable:
                    continue
                try:
                    data = self.socket.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    if not lifecycle.stopping.is_set():
                        logger.warning("worker %s: its supervisor %s is gone", lifecycle.name, self.supervisor)
                    stop(f"its supervisor {self.supervisor} is gone", Ending.STOP)
                    return
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    command = line.decode(errors="replace").strip()
                    if command == NOW:
                        exit_now()
                    elif command == STOP:
                        self._told = True  # it knows why
                        stop(f"its supervisor {self.supervisor} asked", Ending.STOP)
                    else:
                        logger.warning("worker %s: unknown word from its supervisor: %r", lifecycle.name, command)
            self._tell_leaving(lifecycle)  # a worker that stopped at once may finish before the first look
        finally:
            self.socket.close()

    def _tell_leaving(self, lifecycle: Lifecycle) -> None:
        if lifecycle.stopping.is_set() and not self._told:
            self._told = True
            self.send(f"leaving {lifecycle.ending} {lifecycle.why}")
