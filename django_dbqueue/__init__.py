"""django-dbqueue: the database you already run, as a reliable message and job queue."""

from __future__ import annotations

from typing import Any

from ._version import __version__

# The public API, imported lazily so that ``import django_dbqueue`` works
# before Django's app registry is ready (settings, INSTALLED_APPS).
_EXPORTS = {
    "enqueue": "operations",
    "enqueue_many": "operations",
    "claim": "operations",
    "ack_many": "operations",
    "handler": "handlers",
    "schedule": "schedules.registry",
    "Reject": "handlers",
    "Retry": "handlers",
    "Defer": "handlers",
    "publish": "topics",
    "subscribers": "topics",
    "subscribe": "topics",
    "unsubscribe": "topics",
    "request": "request_reply",
    "reply": "request_reply",
    "enqueue_on_save": "outbox",
    "enqueue_on_delete": "outbox",
    "publish_on_save": "outbox",
    "publish_on_delete": "outbox",
    "enqueue_saved": "outbox",
    "replay": "control",
    "cancel": "control",
    "DbQueueError": "exceptions",
    "DuplicateKey": "exceptions",
    "AlreadyReplayed": "exceptions",
    "InvalidQueueName": "exceptions",
    "PayloadNotSerializable": "exceptions",
    "InvalidOption": "exceptions",
    "UnknownOption": "exceptions",
    "LeaseLost": "exceptions",
    "NotClaimed": "exceptions",
    "ImproperlyConfiguredQueue": "exceptions",
    "CommandFailed": "exceptions",
    "RequestTimeout": "exceptions",
    "RequestFailed": "exceptions",
    "TaskNotCompleted": "exceptions",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'django_dbqueue' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_dbqueue.{module}"), name)
