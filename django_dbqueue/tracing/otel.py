"""The spans: a PRODUCER span per enqueue, a CONSUMER span per handler run, linked through the headers.

The enqueue span is short: it marks the enqueue in the caller's trace and
its context goes into the message's headers (``traceparent``, and
``tracestate`` when there is one). The handler's span is that span's child,
however long the message waited and whichever worker ran it, and it is
the current span while the handler runs, so the handler's own spans
(database queries, HTTP calls) nest under it.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import propagation, signals
from .._version import __version__

TRACER_NAME = "django_dbqueue"
SYSTEM = "dbqueue"
CONTEXT_HEADERS = ("traceparent", "tracestate")
# Outcomes that are errors of the run (a retry or a deferral was asked for; an ack is fine).
ERRORS = {"failed", "rejected", "unhandled"}

_tracer: trace.Tracer | None = None
_running = threading.local()  # message id -> (span, context token), for the thread running the handler


def tracer() -> trace.Tracer:
    assert _tracer is not None, "tracing is not enabled"
    return _tracer


def inject(queue: str, kind: str, headers: dict[str, Any]) -> dict[str, Any]:
    """Start and end the enqueue span; put its context in the headers (unless the caller gave one)."""
    if any(name in headers for name in CONTEXT_HEADERS):
        return headers
    with tracer().start_as_current_span(
        f"{queue} publish",
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "publish",
            "messaging.destination.name": queue,
            "dbqueue.kind": kind,
        },
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return {**headers, **{k: v for k, v in carrier.items() if k in CONTEXT_HEADERS}}


def on_started(sender: Any, message: Any, worker: str = "", **kwargs: Any) -> None:
    headers = message.headers if isinstance(message.headers, dict) else {}
    parent = propagate.extract({k: str(v) for k, v in headers.items() if k in CONTEXT_HEADERS})
    span = tracer().start_span(
        f"{message.queue} process",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.destination.name": message.queue,
            "messaging.message.id": str(message.pk),
            "dbqueue.kind": message.kind,
            "dbqueue.attempt": message.attempts,
            "dbqueue.worker": worker,
        },
    )
    token = context.attach(trace.set_span_in_context(span))
    spans = getattr(_running, "spans", None)
    if spans is None:
        spans = _running.spans = {}
    spans[message.pk] = (span, token)


def on_finished(sender: Any, message: Any, outcome: str, **kwargs: Any) -> None:
    spans = getattr(_running, "spans", {})
    found = spans.pop(message.pk, None)
    if found is None:
        return
    span, token = found
    span.set_attribute("dbqueue.outcome", outcome)
    if outcome in ERRORS:
        span.set_status(Status(StatusCode.ERROR, f"handler outcome: {outcome}"))
    context.detach(token)
    span.end()


def connect(tracer_provider: trace.TracerProvider | None = None) -> None:
    global _tracer
    _tracer = trace.get_tracer(TRACER_NAME, __version__, tracer_provider=tracer_provider)
    propagation.add(inject)
    signals.handler_started.connect(on_started, dispatch_uid="django_dbqueue.tracing.started")
    signals.handler_finished.connect(on_finished, dispatch_uid="django_dbqueue.tracing.finished")


def disconnect() -> None:
    propagation.remove(inject)
    signals.handler_started.disconnect(dispatch_uid="django_dbqueue.tracing.started")
    signals.handler_finished.disconnect(dispatch_uid="django_dbqueue.tracing.finished")
