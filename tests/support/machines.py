"""Running the stateful property tests (Hypothesis state machines) with a profile per database, and moving
their database's clock on."""

from __future__ import annotations

import os
from datetime import timedelta

from django.db import connection
from django.db.models import F
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from django_dbqueue.models import RateSlot, UniqueWindow
from django_dbqueue.models.timetravel import shift_back

# ``DBQUEUE_PROPERTIES=long`` selects the long runs docs/reliability.md records; ``ci`` is the default.
PROFILE = os.environ.get("DBQUEUE_PROPERTIES", "ci")

Profiles = dict[str, dict[str, tuple[int, int]]]  # profile -> vendor -> (max_examples, stateful_step_count)


def run_machine(machine: type[RuleBasedStateMachine], profiles: Profiles) -> None:
    """Run ``machine`` for the selected profile's examples and steps on this test database."""
    examples, steps = profiles[PROFILE][connection.vendor]
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def advance(seconds: int) -> None:
    """Let ``seconds`` pass for everything the queue times: live messages, rate slots, unique windows."""
    amount = timedelta(seconds=seconds)
    shift_back("default", amount)
    RateSlot.objects.update(used_at=F("used_at") - amount)
    UniqueWindow.objects.update(until=F("until") - amount)
