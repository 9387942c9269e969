"""Metrics read from the database: queue depth by state and the oldest ready message's age, and the pools'
sizes and events from their supervisors' rows, cached.

Every scrape of every process would otherwise count the queue table; the
reading is kept ``CACHE_SECONDS`` per database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from django.db import connections
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..models import Message, Worker
from .labels import OTHER, queue_label

CACHE_SECONDS = 5.0
#: Queues labelled one by one, deepest first; the rest add up under "other".
MAX_QUEUES = 200

_cache: dict[str, tuple[float, dict[str, dict[str, float]]]] = {}
_pool_cache: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}
_lock = threading.Lock()
# What a supervisor's row counts since it started (worker/supervisor.py, pool_state).
POOL_EVENTS = ("started", "restarted", "recycled", "grown", "shrunk")


def read_pools(using: str) -> dict[str, dict[str, Any]]:
    """``{supervisor name: its pool's state}`` of the pools on ``using``, at most CACHE_SECONDS old."""
    with _lock:
        cached = _pool_cache.get(using)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        rows = Worker.objects.using(using).filter(pool__isnull=False).values_list("name", "pool")
        values = {name: pool for name, pool in rows if isinstance(pool, dict)}
        _pool_cache[using] = (time.monotonic(), values)
        return values


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
        processes = GaugeMetricFamily(
            "dbqueue_pool_processes", "A pool's child processes at work (runqueueworker --processes).", labels=["pool"]
        )
        target = GaugeMetricFamily(
            "dbqueue_pool_target_processes",
            "The children a pool aims at (autoscaled: between MIN and MAX).",
            labels=["pool"],
        )
        events = CounterMetricFamily(
            "dbqueue_pool_events",
            "Children a pool started, restarted after a death, recycled, and its autoscaling's steps.",
            labels=["pool", "event"],
        )
        try:
            values = read(self.using)
            pools = read_pools(self.using)
        finally:
            if self.close:
                connections[self.using].close()
        for queue, entry in sorted(values.items()):
            for state in ("ready", "scheduled", "in_flight"):
                depth.add_metric([queue, state], entry[state])
            age.add_metric([queue], entry["oldest_ready_age"])
        for name, pool in sorted(pools.items()):
            processes.add_metric([name], pool.get("processes", 0))
            target.add_metric([name], pool.get("target", 0))
            for event in POOL_EVENTS:
                events.add_metric([name, event], pool.get(event, 0))
        yield depth
        yield age
        yield processes
        yield target
        yield events
