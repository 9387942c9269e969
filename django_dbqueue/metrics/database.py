"""Metrics read from the database: queue depth by state and the oldest ready message's age, cached.

Every scrape of every process would otherwise count the queue table; the
reading is kept ``CACHE_SECONDS`` per database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from django.db import connections
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..models import Message
from .labels import OTHER, queue_label

CACHE_SECONDS = 5.0
#: Queues labelled one by one, deepest first; the rest add up under "other".
MAX_QUEUES = 200

_cache: dict[str, tuple[float, dict[str, dict[str, float]]]] = {}
_lock = threading.Lock()


def read(using: str) -> dict[str, dict[str, float]]:
    """``{queue: {"ready": n, "scheduled": n, "in_flight": n, "oldest_ready_age": s}}``, at most CACHE_SECONDS old."""
    with _lock:
        cached = _cache.get(using)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        rows = Message.objects.using(using)
        counts = rows.counts_by_queue()
        values: dict[str, dict[str, float]] = {}
        by_depth = sorted(counts.items(), key=lambda item: -sum(item[1].values()))
        for rank, (queue, states) in enumerate(by_depth):
            label = queue_label(queue) if rank < MAX_QUEUES else OTHER
            entry = values.setdefault(label, {"ready": 0, "scheduled": 0, "in_flight": 0, "oldest_ready_age": 0.0})
            for state, n in states.items():
                entry[state] += n
            if states["ready"]:
                age = rows.oldest_ready_age(queue)
                if age is not None:
                    entry["oldest_ready_age"] = max(entry["oldest_ready_age"], age.total_seconds())
        _cache[using] = (time.monotonic(), values)
        return values


class DatabaseCollector(Collector):
    """Collected at each scrape (from the cache): not counted by any process, so never summed across them."""

    def __init__(self, using: str = "default", *, close: bool = False) -> None:
        self.using = using
        self.close = close  # a scrape thread of its own (queuemetrics) closes its connection

    def collect(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("dbqueue_queue_depth", "Live messages by state.", labels=["queue", "state"])
        age = GaugeMetricFamily(
            "dbqueue_oldest_ready_age_seconds", "How long the oldest ready message has waited.", labels=["queue"]
        )
        try:
            values = read(self.using)
        finally:
            if self.close:
                connections[self.using].close()
        for queue, entry in sorted(values.items()):
            for state in ("ready", "scheduled", "in_flight"):
                depth.add_metric([queue, state], entry[state])
            age.add_metric([queue], entry["oldest_ready_age"])
        yield depth
        yield age
