"""Prometheus metrics (the extra ``metrics``: prometheus_client). See docs/metrics.md.

- `view`: the exposition, to mount in urls.py;
- ``manage.py queuemetrics --port``: the same on a port of its own, for workers;
- `enable`: count what this process does (``DBQUEUE["METRICS"] = True``
  calls it when the app starts).

Nothing here imports prometheus_client until it is used, so the package
works without the extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse


def view(request: HttpRequest) -> HttpResponse:
    """The metrics of this process (or of every process, in multi-process mode) and of the database."""
    from .exposition import metrics_view

    return metrics_view(request)


def enable() -> None:
    """Connect the counters to the signals of this process (idempotent)."""
    from .instruments import connect

    connect()


def disable() -> None:
    """Disconnect the counters (the values counted so far stay)."""
    from .instruments import disconnect

    disconnect()
