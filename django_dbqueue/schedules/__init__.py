"""Recurring messages: cron schedules that fire exactly once per slot across any number of processes.

The package is cut by layer, so importing it costs nothing: ``timing``,
``policy`` and ``spec`` are pure computation (the settings module uses
``spec``); ``registry`` holds the declarations (``@schedule``);
``scheduler`` fires them through the model layer
(`django_dbqueue.models.schedules`). See docs/schedules.md.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "schedule": "registry",
    "declared": "registry",
    "Scheduler": "scheduler",
    "PassReport": "scheduler",
    "run_now": "scheduler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'django_dbqueue.schedules' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"django_dbqueue.schedules.{module}"), name)
