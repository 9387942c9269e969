"""What users' type checkers see of the public API: checked by mypy (``tox -e types``), never run.

Each ``assert_type`` fails the mypy run if a public signature loses its
types (a missing annotation turns a result into ``Any``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, assert_type

import django_dbqueue
from django_dbqueue import (
    acancel,
    ack_many,
    aenqueue,
    aenqueue_many,
    apublish,
    arequest,
    claim,
    enqueue,
    enqueue_many,
    publish,
    request,
)
from django_dbqueue.models import ArchivedMessage, Message


def producing() -> None:
    assert_type(enqueue("emails", {"to": "a@example.com"}, delay=timedelta(seconds=5)), Message)
    assert_type(enqueue_many("emails", [{"n": 1}, {"n": 2}]), list[Message])
    assert_type(publish("orders.created", {"id": 7}), list[Message])
    assert_type(Message.objects.using("default").enqueue("emails", {}), Message)


async def producing_from_async_code() -> None:
    assert_type(await aenqueue("emails", {"to": "a@example.com"}, delay=timedelta(seconds=5)), Message)
    assert_type(await aenqueue_many("emails", [{"n": 1}, {"n": 2}]), list[Message])
    assert_type(await apublish("orders.created", {"id": 7}), list[Message])
    assert_type(await arequest("pricing", {"sku": "A1"}, timeout=5), Any)
    assert_type(await acancel(7), django_dbqueue.CancelResult)


def consuming() -> None:
    messages = claim(["emails", "sms"], 10, visibility_timeout=30)
    assert_type(messages, list[Message])
    assert_type(messages[0].ack(result={"sent": True}), bool | None)  # None: unknown (ARCHIVE off, a lost reply)
    assert_type(messages[0].fail(ValueError("bounced")), bool)
    assert_type(messages[0].set_progress(3, 10, note="rows"), None)
    assert_type(messages[0].update_meta(rows=3), None)
    assert_type(messages[0].cancel_requested(), bool)
    assert_type(ack_many(messages), list[bool | None])
    assert_type(Message.objects.claim("emails"), list[Message])


def operating() -> None:
    row = ArchivedMessage.objects.dead().get(pk=1)
    assert_type(django_dbqueue.replay(row), Message)
    assert_type(django_dbqueue.cancel(7), django_dbqueue.CancelResult)
    assert_type(request("pricing", {"sku": "A1"}, timeout=5), Any)  # the reply: any JSON
