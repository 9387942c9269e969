"""The testing tools themselves (imported lazily by `django_dbqueue.testing`).

They work on the test's own database connection, so they see what the
test wrote inside its transaction, as a worker process could not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..conf import database_for
from ..models import ArchivedMessage, Message, timetravel
from ..validation import seconds as to_seconds
from . import immediate as immediate_mode
from .draining import QueueStillBusy as QueueStillBusy
from .draining import run_ready


def contains(value: Any, part: Any) -> bool:
    """Whether ``part`` is in ``value``: a sub-dict (recursively), items of a list, a substring, or equal."""
    if isinstance(part, dict):
        return isinstance(value, dict) and all(k in value and contains(value[k], v) for k, v in part.items())
    if isinstance(part, list) and isinstance(value, list):
        return all(any(contains(item, p) for item in value) for p in part)
    if isinstance(part, str) and isinstance(value, str):
        return part in value
    return bool(value == part)


def _describe(messages: list[Message]) -> str:
    if not messages:
        return "  (none)"
    return "\n".join(
        f"  #{m.pk} kind={m.kind!r} payload={m.payload!r}" + (f" headers={m.headers!r}" if m.headers else "")
        for m in messages
    )


class QueueTestTools:
    """The testing methods; stateless, so a ``TestCase`` may inherit them (`QueueTestMixin`)."""

    def enqueued(self, queue: str, *, kind: str | None = None, using: str | None = None) -> list[Message]:
        """The live messages of ``queue`` (waiting, scheduled or running), oldest first.

        Messages that already ran are in the archive: `archived`.
        """
        rows = Message.objects.using(using or database_for(queue)).filter(queue=queue)
        if kind is not None:
            rows = rows.filter(kind=kind)
        return list(rows.order_by("id"))

    def archived(self, queue: str, *, outcome: str | None = None, using: str | None = None) -> list[ArchivedMessage]:
        """The archive rows of ``queue`` (``outcome``: acked, dead, expired, cancelled), oldest first."""
        rows = ArchivedMessage.objects.using(using or database_for(queue)).filter(queue=queue)
        if outcome is not None:
            rows = rows.filter(outcome=outcome)
        return list(rows.order_by("id"))

    def assert_enqueued(
        self,
        queue: str,
        *,
        kind: str | None = None,
        payload: Any = None,
        payload__contains: Any = None,
        headers__contains: dict[str, Any] | None = None,
        count: int | None = None,
        using: str | None = None,
    ) -> list[Message]:
        """Assert that ``queue`` holds live messages that match; returns them.

        ``payload`` must equal; ``payload__contains`` is a part of the
        payload (keys and values of a dict, recursively; items of a list; a
        substring). ``count`` asks for exactly that many matches, otherwise
        at least one. The failure names the match and lists what the queue holds.
        """
        held = self.enqueued(queue, using=using)
        found = [
            m
            for m in held
            if (kind is None or m.kind == kind)
            and (payload is None or m.payload == payload)
            and (payload__contains is None or contains(m.payload, payload__contains))
            and (headers__contains is None or contains(m.headers, headers__contains))
        ]
        if (count is None and found) or (count is not None and len(found) == count):
            return found
        wanted = ", ".join(
            f"{name}={value!r}"
            for name, value in (
                ("kind", kind),
                ("payload", payload),
                ("payload__contains", payload__contains),
                ("headers__contains", headers__contains),
            )
            if value is not None
        )
        how_many = "at least one" if count is None else f"{count}"
        raise AssertionError(
            f"expected {how_many} message(s) in queue {queue!r}"
            + (f" with {wanted}" if wanted else "")
            + f", found {len(found)}; queue {queue!r} holds {len(held)}:\n{_describe(held)}"
            + self._elsewhere(queue, using)
        )

    def assert_not_enqueued(self, queue: str, *, kind: str | None = None, using: str | None = None) -> None:
        """Assert that ``queue`` holds no live message (of ``kind``)."""
        held = self.enqueued(queue, kind=kind, using=using)
        if held:
            what = f" of kind {kind!r}" if kind is not None else ""
            raise AssertionError(f"expected no message{what} in queue {queue!r}, found {len(held)}:\n{_describe(held)}")

    def _elsewhere(self, queue: str, using: str | None) -> str:
        others = sorted(Message.objects.using(using or database_for(queue)).queue_names() - {queue})
        return f"\nother queues with messages: {', '.join(others)}" if others else ""

    def run_until_empty(
        self, queues: str | Iterable[str] | None = None, *, max_runs: int = 1000, using: str | None = None
    ) -> Counter[str]:
        """Run ready messages of ``queues`` (default: every queue) through their handlers until none is ready.

        In this process and on this connection, with the rules every worker
        follows (`django_dbqueue.running.process`): retries are
        recorded and wait for their backoff, dead letters are archived.
        Messages that handlers enqueue run too when they are ready.
        Returns how many runs had each outcome (``{"acked": 3, "failed": 1}``).
        Raises `QueueStillBusy` after ``max_runs`` runs with work left
        (a handler that enqueues or defers for ever).
        """
        return run_ready(queues, max_runs=max_runs, using=using)

    def make_ready(self, queues: str | Iterable[str] | None = None, *, using: str = "default") -> int:
        """Make every delayed, backing-off or deferred message (of ``queues``) ready now; returns how many."""
        names = [queues] if isinstance(queues, str) else queues
        return timetravel.make_ready(_alias(names, using), names)

    def advance(
        self, amount: float | timedelta, *, queues: str | Iterable[str] | None = None, using: str = "default"
    ) -> int:
        """Let ``amount`` (seconds or a timedelta) pass for the live messages (of ``queues``).

        The database's clock cannot move, so every time of the messages
        moves back instead: delays and backoffs come due, leases and
        ``expires_at`` run out, as if the time had passed. Returns how many
        messages moved.
        """
        names = [queues] if isinstance(queues, str) else queues
        delta = timedelta(seconds=to_seconds(amount, "amount"))
        return timetravel.shift_back(_alias(names, using), delta, names)

    @contextmanager
    def immediate(self) -> Iterator[None]:
        """Inside the block, every message enqueued runs in this process once its transaction commits."""
        with immediate_mode.enabled():
            yield


class QueueTestMixin(QueueTestTools):
    """For Django's ``TestCase``: ``self.run_until_empty()``, ``self.assert_enqueued(...)`` and the rest."""


def _alias(queues: Iterable[str] | None, using: str) -> str:
    names = list(queues) if queues is not None else []
    return database_for(names) if names else using
