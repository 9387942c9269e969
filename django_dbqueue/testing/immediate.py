"""The immediate mode: messages run in the process that enqueued them, once their transaction commits.

For tests that should not need a worker. It listens to ``message_enqueued``,
which is sent once the enqueue is durable, and runs the ready messages of
that queue through `process`, the rules every
worker follows: a failure is recorded and waits for its backoff, a dead
letter is archived. Messages that handlers enqueue while it runs are run
after the current one, not inside it. With ``DBQUEUE["MODE"] = "worker"``
(the default) nothing is connected, so enqueue pays nothing for it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.signals import setting_changed

from ..conf import raw_setting
from ..signals import message_enqueued

logger = logging.getLogger("django_dbqueue")

_state = threading.local()
_enabled_by: set[str] = set()  # "setting", and one entry per open enabled() block
_lock = threading.Lock()
_blocks = itertools.count()


def _pending() -> list[tuple[str, str]]:
    pending: list[tuple[str, str]] | None = getattr(_state, "pending", None)
    if pending is None:
        pending = _state.pending = []
    return pending


def on_enqueued(sender: Any, queue: str, using: str, **kwargs: Any) -> None:
    """Run the queue's ready messages, unless this thread is running some already (then after them)."""
    from .draining import run_ready  # needs the models: imported once Django is set up

    pending = _pending()
    if (queue, using) not in pending:
        pending.append((queue, using))
    if getattr(_state, "running", False):
        return
    _state.running = True
    try:
        while pending:
            name, alias = pending.pop(0)
            run_ready(name, using=alias)
    finally:
        _state.running = False
        pending.clear()


def _update(reason: str, on: bool) -> None:
    with _lock:
        if on:
            _enabled_by.add(reason)
        else:
            _enabled_by.discard(reason)
        if _enabled_by:
            message_enqueued.connect(on_enqueued, dispatch_uid="django_dbqueue.immediate")
        else:
            message_enqueued.disconnect(dispatch_uid="django_dbqueue.immediate")


def follow_setting() -> None:
    """Connect or disconnect the mode as ``DBQUEUE["MODE"]`` says (the system check reports a bad value)."""
    raw = raw_setting()
    _update("setting", isinstance(raw, dict) and raw.get("MODE") == "immediate")


@contextmanager
def enabled() -> Iterator[None]:
    """The immediate mode inside the block, whatever the setting says."""
    reason = f"block {next(_blocks)}"
    _update(reason, True)
    try:
        yield
    finally:
        _update(reason, False)


def _setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "DBQUEUE":
        follow_setting()


setting_changed.connect(_setting_changed, dispatch_uid="django_dbqueue.immediate.setting")
