"""Running ready messages in the test's process: what ``run_until_empty`` and the immediate mode share.

A module of its own so that the immediate mode and the testing tools both
build on it without importing each other.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable

from ..conf import database_for
from ..models import Message
from ..running import process

#: What the test's runs record as the worker that finished a message.
TEST_WORKER = f"tests:{os.getpid()}"


class QueueStillBusy(AssertionError):
    """``run_until_empty`` ran its maximum of messages and some were still ready."""


def run_ready(queues: str | Iterable[str] | None, *, max_runs: int = 1000, using: str | None = None) -> Counter[str]:
    """``QueueTestTools.run_until_empty``, shared with the immediate mode."""
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
        raise ValueError(f"max_runs must be a positive integer, not {max_runs!r}")
    fixed = None if queues is None else ([queues] if isinstance(queues, str) else list(queues))
    outcomes: Counter[str] = Counter()
    runs = 0
    while True:
        # Every queue (queues=None) includes those the handlers' messages start.
        names = fixed if fixed is not None else sorted(Message.objects.using(using or "default").queue_names())
        if not names:
            return outcomes
        alias = using or database_for(names)
        claimed = Message.objects.using(alias).claim(names, worker=TEST_WORKER)
        if not claimed:
            return outcomes
        if runs >= max_runs:
            claimed[0].release()
            raise QueueStillBusy(
                f"still messages ready in {', '.join(names)} after {runs} runs (max_runs): "
                "does a handler enqueue or defer for ever?"
            )
        runs += 1
        outcomes[process(claimed[0], worker=TEST_WORKER)] += 1
