"""Bounded label values: a metric's series must not grow with every reply queue or odd kind."""

from __future__ import annotations

import threading

from ..request_reply import REPLY_QUEUE_PREFIX

#: Distinct (queue, kind) pairs a process labels before the rest count as "other".
MAX_SERIES = 500
OTHER = "other"

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def queue_label(queue: str) -> str:
    """Reply queues (one per request) share one label."""
    return f"{REPLY_QUEUE_PREFIX}*" if queue.startswith(REPLY_QUEUE_PREFIX) else queue


def queue_and_kind(queue: str, kind: str) -> tuple[str, str]:
    """The labels of a (queue, kind): themselves while fewer than MAX_SERIES pairs were seen, else "other"."""
    pair = (queue_label(queue), kind)
    if pair in _seen:
        return pair
    with _lock:
        if len(_seen) < MAX_SERIES:
            _seen.add(pair)
            return pair
    return OTHER, OTHER
