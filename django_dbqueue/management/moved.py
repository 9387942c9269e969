"""Commands that moved to a contrib app keep working from the core, with a warning, for one deprecation period."""

from __future__ import annotations

import warnings
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand


def moved_command(command: type[BaseCommand], app: str) -> type[BaseCommand]:
    """``command`` as it is, warning when ``app`` (its new home) is not in INSTALLED_APPS."""

    class Moved(command):  # type: ignore[misc, valid-type]
        def execute(self, *args: Any, **options: Any) -> Any:
            if not apps.is_installed(app):
                text = (
                    f"manage.py {self.__module__.rsplit('.', 1)[-1]} moved to the app {app!r}: "
                    "add it to INSTALLED_APPS (and run migrate); the core keeps it until 0.4 at the earliest"
                )
                warnings.warn(text, DeprecationWarning, stacklevel=2)
                self.stderr.write(f"Deprecated: {text}")
            return super().execute(*args, **options)

    Moved.__module__ = command.__module__
    Moved.__doc__ = command.__doc__
    return Moved
