"""The counters, histograms and gauges this process updates, fed by the queue's signals.

Created at import (prometheus_client registers them in its default
registry; in multi-process mode it writes them to PROMETHEUS_MULTIPROC_DIR).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal
from prometheus_client import Counter, Gauge, Histogram

from .. import signals
from .labels import queue_and_kind, queue_label

ENQUEUED = Counter("dbqueue_messages_enqueued", "Messages enqueued.", ["queue", "kind"])
ACKED = Counter("dbqueue_messages_acked", "Messages acknowledged.", ["queue", "kind"])
FAILED = Counter("dbqueue_messages_failed", "Failed attempts put back for another one.", ["queue", "kind"])
DEAD = Counter("dbqueue_messages_dead", "Messages archived as dead.", ["queue", "kind"])
HANDLER_SECONDS = Histogram(
    "dbqueue_handler_duration_seconds",
    "How long handlers ran.",
    ["queue", "kind", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
CLAIM_WAIT_SECONDS = Histogram(
    "dbqueue_claim_to_start_seconds",
    "From a message's claim to its handler's start (the worker's own backlog).",
    ["queue"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
)
IN_FLIGHT = Gauge(
    "dbqueue_handlers_in_flight", "Handlers running now, per worker process.", ["queue"], multiprocess_mode="liveall"
)
REAPER = Counter("dbqueue_reaper_actions", "What reaper passes did.", ["action"])
WORKFLOWS = Counter("dbqueue_workflows_finished", "Workflows finished, by outcome.", ["outcome"])

# Claim times by message id, for the claim-to-start wait; bounded (released messages never start).
_claimed: OrderedDict[int, float] = OrderedDict()
_claimed_lock = threading.Lock()
MAX_PENDING_CLAIMS = 10_000


def _labels(message: Any) -> tuple[str, str]:
    return queue_and_kind(message.queue, message.kind)


def on_enqueued(sender: Any, message: Any, **kwargs: Any) -> None:
    ENQUEUED.labels(*_labels(message)).inc()


def on_acked(sender: Any, message: Any, **kwargs: Any) -> None:
    ACKED.labels(*_labels(message)).inc()


def on_failed(sender: Any, message: Any, **kwargs: Any) -> None:
    FAILED.labels(*_labels(message)).inc()


def on_dead(sender: Any, message: Any, **kwargs: Any) -> None:
    DEAD.labels(*_labels(message)).inc()


def on_claimed(sender: Any, message: Any, **kwargs: Any) -> None:
    with _claimed_lock:
        _claimed[message.pk] = time.monotonic()
        while len(_claimed) > MAX_PENDING_CLAIMS:
            _claimed.popitem(last=False)


def on_started(sender: Any, message: Any, **kwargs: Any) -> None:
    with _claimed_lock:
        claimed = _claimed.pop(message.pk, None)
    if claimed is not None:
        CLAIM_WAIT_SECONDS.labels(queue_label(message.queue)).observe(time.monotonic() - claimed)
    IN_FLIGHT.labels(queue_label(message.queue)).inc()


def on_finished(sender: Any, message: Any, outcome: str, duration: float, **kwargs: Any) -> None:
    IN_FLIGHT.labels(queue_label(message.queue)).dec()
    HANDLER_SECONDS.labels(*_labels(message), outcome).observe(duration)


# The counts of a ReapReport that the reaper counter adds up, each its own label value.
REAPER_ACTIONS = (
    "stale_workers",
    "released",
    "poison",
    "cancelled",
    "expired",
    "pruned",
    "workflows_pruned",
    "steps_settled",
    "partitions_created",
    "partitions_dropped",
    "partitions_freed",
)


def on_reaper(sender: Any, report: Any, **kwargs: Any) -> None:
    for action in REAPER_ACTIONS:
        count = getattr(report, action)
        if count:
            REAPER.labels(action).inc(count)


def on_workflow_finished(sender: Any, outcome: str, **kwargs: Any) -> None:
    WORKFLOWS.labels(outcome).inc()  # three values at most: a bounded label


RECEIVERS: list[tuple[Signal, Callable[..., None]]] = [
    (signals.message_enqueued, on_enqueued),
    (signals.message_acked, on_acked),
    (signals.message_failed, on_failed),
    (signals.message_dead_lettered, on_dead),
    (signals.message_claimed, on_claimed),
    (signals.handler_started, on_started),
    (signals.handler_finished, on_finished),
    (signals.reaper_passed, on_reaper),
    (signals.workflow_finished, on_workflow_finished),
]


def connect() -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # This process's live gauges leave the other processes' sums when it exits.
        atexit.register(_process_exits)
    for signal, receiver in RECEIVERS:
        signal.connect(receiver, dispatch_uid=f"django_dbqueue.metrics.{receiver.__name__}")


def _process_exits() -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def disconnect() -> None:
    for signal, receiver in RECEIVERS:
        signal.disconnect(dispatch_uid=f"django_dbqueue.metrics.{receiver.__name__}")
