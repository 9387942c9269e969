"""Declaring schedules in tests, and a clock the tests move by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import django_dbqueue
from django_dbqueue.schedules import registry


class Clock:
    """A stand-in for the database's clock: "now" is whatever the test says."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def declare(name: str, **fields):
    """Declare a schedule in code, as ``@django_dbqueue.schedule`` on a function would."""

    def target(message): ...

    target.__qualname__ = f"declared_{name}"
    django_dbqueue.schedule(name=name, **fields)(target)
    return target


@pytest.fixture
def schedules():
    """Code declarations made in a test go away after it."""
    saved = registry.snapshot()
    yield declare
    registry.restore(saved)
