"""The ``cpu_bound`` phase's handler: pure Python work that holds the GIL, about ``CPU_MS`` per message.

The phase starts real ``runqueueworker`` processes (one with threads, a
pool), which run handlers registered the usual way. The handler of
``queuebench.cpu`` is registered (`register`) only in the processes the
phase started: it sets ``apps.CPU_HANDLER_ENVIRONMENT`` for them, and the
app registers it when it is set, so that no other process of a project
with the bench app installed serves the queue.
"""

from __future__ import annotations

import time
from typing import Any

from ... import handlers

QUEUE = "queuebench.cpu"


def burn(rounds: int) -> int:
    """``rounds`` steps of integer arithmetic in the interpreter: CPU time that no other thread can share."""
    total = 0
    for n in range(rounds):
        total += n * n % 7
    return total


def rounds_for(milliseconds: float) -> int:
    """How many `burn` rounds take ``milliseconds`` here (the best of a few timings, against noise)."""
    sample = 50_000
    best = min(_timed(sample) for _ in range(5))
    return max(1, round(sample * milliseconds / 1000 / best))


def _timed(rounds: int) -> float:
    started = time.perf_counter()
    burn(rounds)
    return time.perf_counter() - started


def cpu_bound(message: Any) -> None:
    burn(int(message.payload["rounds"]))


def register() -> None:
    handlers.handler(QUEUE)(cpu_bound)
