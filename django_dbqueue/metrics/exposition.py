"""What a scrape gets: this process's counters, or every process's in multi-process mode, and the database's."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ..conf import get_settings
from . import instruments  # noqa: F401  (the metric families exist, with or without values)
from .database import DatabaseCollector


class ThisProcess(Collector):
    """Everything of prometheus_client's default registry: our counters, and the process's own metrics."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


def build_registry(using: str | None = None, *, own_thread: bool = False) -> CollectorRegistry:
    """A registry for one exposition.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (several worker or web processes),
    the values come from every process's files in it; otherwise from this
    process. The database's metrics come once, whatever the mode.
    """
    registry = CollectorRegistry(auto_describe=True)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry.register(ThisProcess())
    registry.register(DatabaseCollector(using or get_settings().defaults.database, close=own_thread))
    return registry


def metrics_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse(generate_latest(build_registry()), content_type=CONTENT_TYPE_LATEST)
