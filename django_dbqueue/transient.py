"""Bounded retries for the database's weather: deadlocks and dropped connections.

MySQL may pick any transaction as a deadlock victim, and a database restart
drops every connection. Neither is a bug in the caller, so queue operations
run through :func:`with_retries`, which retries them a bounded number of
times with jittered backoff. Inside a caller's own transaction nothing is
retried: the caller's work is gone with the error and only the caller can
redo it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, InterfaceError, connections

from . import vendor
from .conf import get_settings

logger = logging.getLogger("django_dbqueue")
T = TypeVar("T")

# What a database that went away raises, for the loops that must outlive it
# (workers, reapers): Django's DatabaseError, and its sibling InterfaceError,
# which a driver raises on a connection it already closed (mysqlclient's
# "(0, '')" after a server restart).
DATABASE_TROUBLE = (DatabaseError, InterfaceError)


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
    """Full-jitter exponential backoff: up to base * 2**attempt, at most cap."""
    return random.uniform(0, min(cap, base * 2**attempt))


def with_retries(using: str, operation: Callable[[], T], *, what: str = "queue operation") -> T:
    connection = connections[using]
    retries = get_settings().transient_retries
    attempt = 0
    while True:
        try:
            return operation()
        except DatabaseError as exc:
            if connection.in_atomic_block or attempt >= retries or not vendor.is_transient(exc, using):
                raise
            attempt += 1
            logger.warning("%s on %r hit %s; retry %d of %d", what, using, exc, attempt, retries)
            if vendor.lost_connection(using):
                connection.close()
            time.sleep(backoff(attempt))
