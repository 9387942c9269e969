"""Deprecated: renamed `django_dbqueue.running`, where ``Outcome`` is ``HandlerOutcome``.

Kept so existing imports go on working; importing it warns once.
"""

from __future__ import annotations

import warnings

from .running import HandlerOutcome, Verdict, decide, process

Outcome = HandlerOutcome

__all__ = ["Outcome", "Verdict", "decide", "process"]

warnings.warn(
    "django_dbqueue.dispatch is deprecated: import from django_dbqueue.running, where Outcome is called HandlerOutcome",
    DeprecationWarning,
    stacklevel=2,
)
