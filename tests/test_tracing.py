"""OpenTelemetry: a span per enqueue and per handler run, linked through the traceparent header."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import django_dbqueue
from django_dbqueue import handlers, propagation, tracing
from django_dbqueue.models import Message
from django_dbqueue.running import HandlerOutcome, process

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def spans():
    """Tracing on, into an in-memory exporter of a provider of our own (the global one is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    yield exporter, provider.get_tracer("tests")
    tracing.disable()


@pytest.fixture
def traced_handlers(spans):
    _, inner = spans

    @handlers.handler("t-jobs")
    def job(message):
        with inner.start_as_current_span("inside the handler"):
            if message.payload.get("fail"):
                raise ValueError("boom")
        return "ok"

    yield
    handlers.unregister("t-jobs", None)


def by_name(exporter):
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_request_trace_continues_into_the_handler(spans, traced_handlers):
    exporter, tests_tracer = spans
    with tests_tracer.start_as_current_span("GET /orders") as request_span:
        message = django_dbqueue.enqueue("t-jobs", {"n": 1}, kind="k")
    trace_id = request_span.get_span_context().trace_id
    stored = Message.objects.get(pk=message.pk)
    version, header_trace, header_span, flags = stored.headers["traceparent"].split("-")
    assert int(header_trace, 16) == trace_id and version == "00" and int(flags, 16) & 1  # W3C, sampled

    assert process(Message.objects.claim("t-jobs")[0]) == HandlerOutcome.ACKED
    found = by_name(exporter)
    publish, run = found["t-jobs publish"], found["t-jobs process"]
    assert publish.kind == SpanKind.PRODUCER and publish.parent.span_id == request_span.get_span_context().span_id
    assert int(header_span, 16) == publish.context.span_id
    assert run.kind == SpanKind.CONSUMER and run.context.trace_id == trace_id
    assert run.parent.span_id == publish.context.span_id
    assert run.attributes["messaging.destination.name"] == "t-jobs"
    assert run.attributes["messaging.message.id"] == str(message.pk)
    assert run.attributes["dbqueue.outcome"] == "acked"
    assert run.status.status_code == StatusCode.UNSET
    # The handler's own spans nest under its run.
    assert found["inside the handler"].parent.span_id == run.context.span_id
    assert trace.get_current_span() is trace.INVALID_SPAN  # the run's context was detached


def test_a_failed_run_is_an_error_span(spans, traced_handlers):
    exporter, _ = spans
    django_dbqueue.enqueue("t-jobs", {"fail": True})
    assert process(Message.objects.claim("t-jobs")[0]) == HandlerOutcome.FAILED
    run = by_name(exporter)["t-jobs process"]
    assert run.status.status_code == StatusCode.ERROR and run.attributes["dbqueue.outcome"] == "failed"


def test_enqueue_outside_any_trace_starts_one_and_every_message_gets_its_own_span(spans):
    exporter, _ = spans
    messages = django_dbqueue.enqueue_many("t-jobs", [{}, {}])
    parents = {Message.objects.get(pk=m.pk).headers["traceparent"].split("-")[2] for m in messages}
    assert len(parents) == 2
    assert [s.name for s in exporter.get_finished_spans()] == ["t-jobs publish", "t-jobs publish"]


def test_a_traceparent_given_by_the_caller_is_kept(spans):
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    message = django_dbqueue.enqueue("t-jobs", {}, headers={"traceparent": given})
    assert Message.objects.get(pk=message.pk).headers == {"traceparent": given}


def test_nothing_is_added_when_tracing_is_off():
    assert propagation.hooks == []
    message = django_dbqueue.enqueue("t-jobs", {}, headers={"a": 1})
    assert Message.objects.get(pk=message.pk).headers == {"a": 1}
