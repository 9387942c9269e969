"""The pytest plugin (entry point ``pytest11``): the ``dbqueue`` and ``dbqueue_immediate`` fixtures.

Loaded by pytest wherever django-dbqueue is installed, so it imports
nothing of Django until a test asks for a fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .tools import QueueTestTools


@pytest.fixture
def dbqueue() -> QueueTestTools:
    """``run_until_empty``, ``assert_enqueued``, ``enqueued``, ``make_ready``, ``advance``... (docs/testing.md).

    Mark the test ``django_db`` as for any database access.
    """
    from .tools import QueueTestTools

    return QueueTestTools()


@pytest.fixture
def dbqueue_immediate(dbqueue: QueueTestTools) -> Iterator[QueueTestTools]:
    """The immediate mode for one test: enqueued messages run once their transaction commits."""
    with dbqueue.immediate():
        yield dbqueue
