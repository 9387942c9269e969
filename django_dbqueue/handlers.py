"""Handler registration: which function consumes which queue (and kind).

Handlers live in a ``queues.py`` module of any installed app, discovered at
startup the way the admin finds ``admin.py``::

    @django_dbqueue.handler("emails", kind="welcome")
    def send_welcome(message): ...

A handler's outcome is what it does: return normally (ack), raise any
exception (fail: retry with backoff, dead letter when attempts run out),
or raise one of the control exceptions below.
"""

from __future__ import annotations

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


def handler(queue: str, kind: str | None = None) -> Callable[[Handler], Handler]:
    """Register the decorated function for ``queue`` (and only ``kind``, if given)."""
    validate_queue_name(queue)
    if kind is not None:
        validate_kind(kind)

    def register(function: Handler) -> Handler:
        existing = _registry.get((queue, kind))
        if existing is not None and existing is not function and _name(existing) != _name(function):
            raise ImproperlyConfigured(
                f"two handlers for queue {queue!r}, kind {kind!r}: {_name(existing)} and {_name(function)}"
            )
        _registry[(queue, kind)] = function
        return function

    return register


def find_handler(queue: str, kind: str) -> Handler | None:
    """The handler for this kind in this queue, else the queue's catch-all, else None."""
    return _registry.get((queue, kind)) or _registry.get((queue, None))


def registered() -> dict[tuple[str, str | None], Handler]:
    return dict(_registry)


def unregister(queue: str, kind: str | None = None) -> None:
    _registry.pop((queue, kind), None)


def autodiscover() -> None:
    autodiscover_modules("queues")


def _name(function: Handler) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)!s}"
