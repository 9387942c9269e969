"""The shop's tests, written with django-dbqueue's testing tools: no worker is started."""

from decimal import Decimal

import pytest
from shop.models import EmailSent, Invoice, Order

import django_dbqueue

pytestmark = pytest.mark.django_db


def place(number, email="ada@example.com"):
    return Order.objects.create(number=number, email=email, total=Decimal("12.50"))


def test_an_order_publishes_order_placed_to_both_subscribers(dbqueue):
    order = place("A-1")
    dbqueue.assert_enqueued("email", kind="order-placed", payload={"order_id": order.pk, "number": "A-1"})
    dbqueue.assert_enqueued("invoicing", kind="order-placed", payload__contains={"number": "A-1"})


def test_the_handlers_send_the_confirmation_and_issue_the_invoice(dbqueue):
    order = place("A-2")
    assert dbqueue.run_until_empty(["email", "invoicing"]) == {"acked": 2}
    assert EmailSent.objects.get(order=order).subject == "Your order A-2"
    assert Invoice.objects.get(order=order).number == "INV-A-2"


def test_an_address_the_mail_server_refuses_ends_as_a_dead_letter(dbqueue):
    place("A-3", email="nobody@mail.invalid")
    assert dbqueue.run_until_empty("email") == {"failed": 1}  # attempt 1 of 2, waiting for its backoff
    dbqueue.advance(60)
    assert dbqueue.run_until_empty("email") == {"failed": 1}  # the last attempt
    [dead] = dbqueue.archived("email", outcome="dead")
    assert "mail server refuses nobody@mail.invalid" in dead.last_error
    assert not EmailSent.objects.exists()


def test_a_welcome_mail_to_a_bad_address_is_rejected_at_once(dbqueue):
    django_dbqueue.enqueue("emails", {"to": "not an address"}, kind="welcome")
    assert dbqueue.run_until_empty("emails") == {"rejected": 1}
    assert "not an email address" in dbqueue.archived("emails", outcome="dead")[0].last_error


def test_a_delayed_welcome_mail_waits_for_its_time(dbqueue):
    django_dbqueue.enqueue("emails", {"to": "ada@example.com"}, kind="welcome", delay=3600)
    assert dbqueue.run_until_empty("emails") == {}
    dbqueue.advance(3600)
    assert dbqueue.run_until_empty("emails") == {"acked": 1}


def test_in_immediate_mode_the_order_is_handled_when_it_commits(dbqueue, django_capture_on_commit_callbacks):
    with dbqueue.immediate(), django_capture_on_commit_callbacks(execute=True):
        order = place("A-4")
    assert EmailSent.objects.filter(order=order).exists() and Invoice.objects.filter(order=order).exists()
    dbqueue.assert_not_enqueued("email")
