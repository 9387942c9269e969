"""The events a worker's threads share, and what happens when one of them crashes.

- ``stopping``: stop claiming (a signal, a limit reached, a crash);
- ``finished``: every consumer is done, or abandoned at the end of the
  grace period; heartbeats go on until then, and retries of an outcome give up;
- ``wake``: an idle consumer should claim now (a NOTIFY, a stop).

Each stop says why, and how the worker's run ends (`Ending`): a pool's
supervisor starts a recycled child's replacement before it leaves, and
does not replace a child whose queues are empty.

Every thread of a worker runs through `Lifecycle.thread`: an
exception that escapes its loop is logged with its traceback and stops
the worker, which then exits with ``ExitStatus.ERROR``. A worker never goes
on with less capacity in silence, nor exits 0 after a crash.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("django_dbqueue")


class Ending(enum.StrEnum):
    """How a worker's run ends, as its first stop said."""

    STOP = "stop"  # asked to: a signal, its supervisor
    RECYCLE = "recycle"  # a limit of its own: --max-messages, --max-runtime, its memory
    DONE = "done"  # --until-empty: the queues are empty
    CRASH = "crash"  # a thread crashed


class Lifecycle:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = threading.Event()
        self.finished = threading.Event()
        self.wake = threading.Event()
        self._crashed: list[str] = []
        self._lock = threading.Lock()
        self.why = ""  # why it stopped: the first reason given
        self.ending = Ending.STOP

    def stop(self, why: str, ending: Ending = Ending.STOP) -> None:
        """Stop claiming (once; later calls only wake the idle)."""
        with self._lock:
            first = not self.stopping.is_set()
            if first:
                self.why, self.ending = why, ending
                self.stopping.set()
        if first:
            logger.info("worker %s stopping: %s", self.name, why)
        self.stopping.set()
        self.wake.set()

    def thread(self, target: Callable[[], object], name: str) -> threading.Thread:
        """A daemon thread running ``target``, whose crash stops the worker (not started)."""

        def guarded() -> None:
            try:
                target()
            except BaseException:
                logger.exception("worker %s: thread %s crashed; the worker stops", self.name, name)
                with self._lock:
                    self._crashed.append(name)
                self.stop(f"thread {name} crashed", Ending.CRASH)

        return threading.Thread(target=guarded, name=name, daemon=True)

    @property
    def crashed(self) -> list[str]:
        """The names of the threads that crashed, in order."""
        with self._lock:
            return list(self._crashed)
