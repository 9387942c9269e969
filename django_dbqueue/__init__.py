"""django-dbqueue: the database you already run, as a reliable message and job queue."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    # What type checkers see: each public name, re-exported ("X as X"). At run
    # time __getattr__ below imports it on first use; tests/test_types.py keeps both in step.
    from .control import CancelResult as CancelResult, acancel as acancel, cancel as cancel, replay as replay
    from .exceptions import (
        AlreadyReplayed as AlreadyReplayed,
        Cancelled as Cancelled,
        CommandFailed as CommandFailed,
        DbQueueError as DbQueueError,
        DuplicateKey as DuplicateKey,
        HandlerTimeout as HandlerTimeout,
        ImproperlyConfiguredQueue as ImproperlyConfiguredQueue,
        InvalidOption as InvalidOption,
        InvalidQueueName as InvalidQueueName,
        LeaseLost as LeaseLost,
        NotClaimed as NotClaimed,
        PayloadNotSerializable as PayloadNotSerializable,
        RequestFailed as RequestFailed,
        RequestTimeout as RequestTimeout,
        TaskNotCompleted as TaskNotCompleted,
        UnknownOption as UnknownOption,
    )
    from .handlers import Defer as Defer, Reject as Reject, Retry as Retry, handler as handler
    from .operations import (
        ack_many as ack_many,
        aenqueue as aenqueue,
        aenqueue_many as aenqueue_many,
        claim as claim,
        enqueue as enqueue,
        enqueue_many as enqueue_many,
    )
    from .outbox import (
        enqueue_on_delete as enqueue_on_delete,
        enqueue_on_save as enqueue_on_save,
        enqueue_saved as enqueue_saved,
        publish_on_delete as publish_on_delete,
        publish_on_save as publish_on_save,
    )
    from .request_reply import arequest as arequest, reply as reply, request as request
    from .schedules.registry import schedule as schedule
    from .topics import (
        apublish as apublish,
        publish as publish,
        subscribe as subscribe,
        subscribers as subscribers,
        unsubscribe as unsubscribe,
    )
    from .workflows import Dep as Dep, Step as Step, Workflow as Workflow


# The public API, imported lazily so that ``import django_dbqueue`` works
# before Django's app registry is ready (settings, INSTALLED_APPS).
_EXPORTS = {
    "enqueue": "operations",
    "enqueue_many": "operations",
    "aenqueue": "operations",
    "aenqueue_many": "operations",
    "claim": "operations",
    "ack_many": "operations",
    "handler": "handlers",
    "schedule": "schedules.registry",
    "Reject": "handlers",
    "Retry": "handlers",
    "Defer": "handlers",
    "publish": "topics",
    "apublish": "topics",
    "subscribers": "topics",
    "subscribe": "topics",
    "unsubscribe": "topics",
    "request": "request_reply",
    "arequest": "request_reply",
    "reply": "request_reply",
    "enqueue_on_save": "outbox",
    "enqueue_on_delete": "outbox",
    "publish_on_save": "outbox",
    "publish_on_delete": "outbox",
    "enqueue_saved": "outbox",
    "replay": "control",
    "cancel": "control",
    "acancel": "control",
    "CancelResult": "control",
    "Cancelled": "exceptions",
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
    "HandlerTimeout": "exceptions",
    "RequestTimeout": "exceptions",
    "RequestFailed": "exceptions",
    "TaskNotCompleted": "exceptions",
    "Workflow": "workflows",
    "Step": "workflows",
    "Dep": "workflows",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'django_dbqueue' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_dbqueue.{module}"), name)
