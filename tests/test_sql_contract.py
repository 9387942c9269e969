"""The plain-SQL INSERTs of docs/table-layout.md work, and the API consumes what they insert.

The statements are read from the page itself, so the docs cannot drift
from what the database accepts.
"""

import re
from pathlib import Path

import pytest
from django.db import connection

from django_dbqueue.models import ArchivedMessage, Message

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "table-layout.md"


def statements(vendor: str) -> dict[str, str]:
    """``{title: sql}`` for every ``-- <vendor>: <title>`` statement on the page."""
    blocks = re.findall(r"```sql\n(.*?)```", PAGE.read_text(), re.DOTALL)
    found = {}
    for block in blocks:
        for chunk in re.split(r";\s*\n", block):
            match = re.match(rf"\s*-- {vendor}: (.+?)\n(.*)", chunk, re.DOTALL)
            if match:
                found[match.group(1).strip()] = match.group(2).strip()
    return found


def execute(sql: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql)


def test_the_page_has_the_three_inserts_for_each_database():
    for vendor in ("mysql", "postgresql", "sqlite"):
        assert set(statements(vendor)) == {
            "one message, ready now",
            "ready in one hour",
            "with a deduplication key (a second run inserts nothing)",
        }, vendor


def test_documented_inserts_are_claimed_and_acked_through_the_api():
    sql = statements(connection.vendor)
    execute(sql["one message, ready now"])
    execute(sql["ready in one hour"])
    execute(sql["with a deduplication key (a second run inserts nothing)"])
    execute(sql["with a deduplication key (a second run inserts nothing)"])
    assert Message.objects.filter(queue="emails").count() == 3  # the keyed one once
    assert Message.objects.scheduled().get().kind == "reminder"

    claimed = Message.objects.claim("emails", 10)
    assert [(m.kind, m.payload) for m in claimed] == [
        ("welcome", {"to": "ada@example.com"}),
        ("receipt", {"order": 1001}),
    ]
    welcome, receipt = claimed
    assert welcome.headers == {"correlation_id": "c-1"} and welcome.attempts == 1
    assert receipt.key == "receipt-1001"
    assert Message.objects.ack_many(claimed) == [True, True]
    rows = ArchivedMessage.objects.acked().order_by("message_id")
    assert [r.payload for r in rows] == [{"to": "ada@example.com"}, {"order": 1001}]
    assert all(r.first_available_at <= r.claimed_at <= r.finished_at for r in rows)
