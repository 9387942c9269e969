"""Handler registration: which function consumes which queue (and kind).

Handlers live in a ``queues.py`` module of any installed app, discovered at
startup the way the admin finds ``admin.py``::

    @django_dbqueue.handler("emails", kind="welcome")
    def send_welcome(message): ...

A handler's outcome is what it does: return normally (ack), raise any
exception (fail: retry with backoff, dead letter when attempts run out),
or raise one of the control exceptions below. ``atomic=True`` runs it in
one transaction with its acknowledgement (docs/workers.md, "Atomic handlers").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import autodiscover_modules

from .validation import validate_kind, validate_queue_name

if TYPE_CHECKING:
    from .models import Message

Handler = Callable[["Message"], Any]

# (queue, kind) -> handler; kind None is the queue's catch-all.
_registry: dict[tuple[str, str | None], Handler] = {}
# The registrations whose handler runs in its acknowledgement's transaction.
_atomic: set[tuple[str, str | None]] = set()


class Reject(Exception):
    """Raise in a handler to dead-letter the message now, with ``reason``."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Raise in a handler to put the message back after ``delay`` (counts as an attempt)."""

    def __init__(self, delay: float | timedelta = 0, reason: str = "") -> None:
        super().__init__(reason or f"retry in {delay}")
        self.delay = delay
        self.reason = reason


class Defer(Exception):
    """Raise in a handler to put the message off until ``until`` without counting a failure."""

    def __init__(self, until: datetime | None = None, *, delay: float | timedelta | None = None) -> None:
        if (until is None) == (delay is None):
            raise TypeError("Defer needs exactly one of until= or delay=")
        super().__init__(f"deferred until {until}" if until else f"deferred by {delay}")
        self.until = until
        self.delay = delay


def handler(queue: str, kind: str | None = None, *, atomic: bool = False) -> Callable[[Handler], Handler]:
    """Register the decorated function for ``queue`` (and only ``kind``, if given).

    ``atomic``: the handler runs inside a transaction on the queue's
    database that also acknowledges its message, so its writes there are
    committed exactly when the message is acked (docs/workers.md).
    """
    validate_queue_name(queue)
    if kind is not None:
        validate_kind(kind)
    if not isinstance(atomic, bool):
        raise ImproperlyConfigured(f"atomic must be True or False, not {atomic!r}")

    def register(function: Handler) -> Handler:
        existing = _registry.get((queue, kind))
        if existing is not None and existing is not function and _name(existing) != _name(function):
            raise ImproperlyConfigured(
                f"two handlers for queue {queue!r}, kind {kind!r}: {_name(existing)} and {_name(function)}"
            )
        if atomic and is_async(function):
            raise ImproperlyConfigured(
                f"{_name(function)} is async: an atomic handler must be a plain function, "
                "as Django's transactions are synchronous"
            )
        _registry[(queue, kind)] = function
        if atomic:
            _atomic.add((queue, kind))
        else:
            _atomic.discard((queue, kind))
        return function

    return register


def is_async(handler: Handler | None) -> bool:
    """Whether ``handler`` is an ``async def`` function (or a callable whose ``__call__`` is one)."""
    if handler is None:
        return False
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


def _registration(queue: str, kind: str) -> tuple[str, str | None] | None:
    """The registry's key serving this kind in this queue: its own, else the queue's catch-all."""
    for key in ((queue, kind), (queue, None)):
        if key in _registry:
            return key
    return None


def find_handler(queue: str, kind: str) -> Handler | None:
    """The handler for this kind in this queue, else the queue's catch-all, else None."""
    key = _registration(queue, kind)
    return None if key is None else _registry[key]


def runs_atomic(queue: str, kind: str, function: Handler) -> bool:
    """Whether ``function`` is the handler that serves this kind in this queue, registered with ``atomic=True``."""
    key = _registration(queue, kind)
    return key is not None and key in _atomic and _registry[key] is function


def is_atomic(queue: str, kind: str | None) -> bool:
    """Whether the registration of ``queue`` and ``kind`` (None: the catch-all) has ``atomic=True``."""
    return (queue, kind) in _atomic


def registered() -> dict[tuple[str, str | None], Handler]:
    return dict(_registry)


def unregister(queue: str, kind: str | None = None) -> None:
    _registry.pop((queue, kind), None)
    _atomic.discard((queue, kind))


def autodiscover() -> None:
    autodiscover_modules("queues")


def _name(function: Handler) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)!s}"
