"""Deprecated: the queue analytics moved to the app `django_dbqueue.contrib.spark`.

Its names still resolve from here, with a ``DeprecationWarning``; add
``"django_dbqueue.contrib.spark"`` to ``INSTALLED_APPS`` and import from there
(docs/versions.md says how long this keeps working).
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from django_dbqueue.contrib import spark

    if name not in spark.__all__:
        raise AttributeError(f"module 'django_dbqueue.analytics' has no attribute {name!r}")
    warnings.warn(
        f"django_dbqueue.analytics.{name} moved to django_dbqueue.contrib.spark.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(spark, name)
