"""Roles the concurrency tests run in separate processes (see tests/support/processes.py)."""

from __future__ import annotations

import json
import os
import sys
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django_dbqueue import enqueue, enqueue_many  # noqa: E402
from django_dbqueue.models import ArchivedMessage, Message  # noqa: E402


def wait_until(start_at: float) -> None:
    """All children of a race start together, at the same wall-clock instant."""
    time.sleep(max(0.0, start_at - time.time()))


def produce(queue: str, first: str, count: str, chunk: str) -> dict:
    first_n, total, size = int(first), int(count), int(chunk)
    for start in range(first_n, first_n + total, size):
        numbers = range(start, min(start + size, first_n + total))
        if size == 1:
            enqueue(queue, {"n": numbers[0]})
        else:
            enqueue_many(queue, [{"n": n} for n in numbers])
    return {"produced": total}


def consume(queue: str, expected: str, batch: str, deadline: str) -> dict:
    """Claim and ack until the archive holds ``expected`` messages of ``queue``."""
    size, end = int(batch), time.time() + float(deadline)
    acked: list[int] = []
    while time.time() < end:
        messages = Message.objects.claim(queue, size, visibility_timeout=120)
        if not messages:
            if ArchivedMessage.objects.filter(queue=queue).count() >= int(expected):
                return {"acked": acked}
            time.sleep(0.02)
            continue
        if size == 1:
            acked += [m.pk for m in messages if m.ack()]
        else:
            acked += [m.pk for m, ok in zip(messages, Message.objects.ack_many(messages), strict=True) if ok]
    raise SystemExit(f"deadline passed with {len(acked)} acked")


def dedup(queue: str, key: str, start_at: str) -> dict:
    wait_until(float(start_at))
    message = enqueue(queue, {"by": os.getpid()}, key=key)
    return {"id": message.pk, "created": message.was_created}


def unique_window(queue: str, key: str, seconds: str, start_at: str) -> dict:
    wait_until(float(start_at))
    message = enqueue(queue, {"by": os.getpid()}, key=key, unique=float(seconds))
    return {"id": message.pk, "created": message.was_created}


def debounce(queue: str, key: str, writes: str, start_at: str) -> dict:
    """Write ``writes`` debounced payloads of one key, numbered; the last of them all must be the one kept."""
    wait_until(float(start_at))
    created = 0
    for seq in range(int(writes)):
        message = enqueue(queue, {"by": os.getpid(), "seq": seq}, key=key, debounce=30)
        created += message.was_created
    return {"created": created, "id": message.pk}


def grouped(queue: str, groups: str, per_group: str, start_at: str) -> dict:
    """Enqueue ``per_group`` messages into each of ``groups`` groups, the groups in turn (interleaved with racers)."""
    wait_until(float(start_at))
    ids = []
    for n in range(int(per_group)):
        for g in range(int(groups)):
            ids.append(enqueue(queue, {"g": g, "n": n, "fail": n % 3 == 1}, group=f"g{g}").pk)
    return {"ids": ids}


ROLES = {
    "produce": produce,
    "consume": consume,
    "dedup": dedup,
    "unique-window": unique_window,
    "debounce": debounce,
    "grouped": grouped,
}

if __name__ == "__main__":
    role, *args = sys.argv[1:]
    print(json.dumps(ROLES[role](*args)))
