"""OpenTelemetry tracing (the extra ``otel``). See docs/tracing.md.

`enable` (which ``DBQUEUE["TRACING"] = True`` calls when the app
starts) adds a span per enqueue and per handler run, and carries the trace
context in the message's headers (W3C ``traceparent``), so a web request's
trace continues in the worker. Nothing imports OpenTelemetry until then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


def enable(tracer_provider: TracerProvider | None = None) -> None:
    """Start tracing (idempotent); ``tracer_provider`` defaults to OpenTelemetry's global one."""
    from .otel import connect

    connect(tracer_provider)


def disable() -> None:
    from .otel import disconnect

    disconnect()
