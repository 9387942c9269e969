"""The shop's message handlers and outbox rules, discovered by django-dbqueue at startup."""

from decimal import Decimal

import django_dbqueue

from .models import EmailSent, Invoice, Order

# --- plain enqueue: the 'emails' queue of the first part of the demo ----------------


@django_dbqueue.handler("emails", kind="welcome")
def send_welcome(message):
    if "@" not in message.payload["to"]:
        # A bad address will not get better with retries: dead-letter it now.
        raise django_dbqueue.Reject(f"not an email address: {message.payload['to']!r}")
    return f"welcome mail to {message.payload['to']}"


@django_dbqueue.handler("emails")
def send_other(message):
    if message.payload.get("flaky") and message.attempts < 2:
        raise ConnectionError("mail server busy, will retry")
    return f"{message.kind or 'plain'} mail to {message.payload['to']}"


# --- the transactional outbox and a topic --------------------------------------------
# Saving a new Order publishes "order-placed" to topic "orders" in the same
# transaction. Queue "email" subscribes in settings.DBQUEUE["TOPICS"], queue
# "invoicing" in the Subscription table (migration shop 0002, editable in the admin).

django_dbqueue.publish_on_save(
    Order,
    "orders",
    kind="order-placed",
    payload=lambda order: {"order_id": order.pk, "number": order.number},
    key=lambda order: f"order-{order.pk}",
    when="created",
)


@django_dbqueue.handler("email", kind="order-placed")
def send_order_confirmation(message):
    order = Order.objects.get(pk=message.payload["order_id"])
    if order.email.endswith(".invalid"):
        # Fails every attempt: with MAX_ATTEMPTS 2 the message ends as a dead letter to fix and replay.
        raise ConnectionError(f"mail server refuses {order.email}")
    EmailSent.objects.create(order=order, to=order.email, subject=f"Your order {order.number}")
    return {"to": order.email}


@django_dbqueue.handler("invoicing", kind="order-placed")
def issue_invoice(message):
    order = Order.objects.get(pk=message.payload["order_id"])
    # Delivery is at least once: get_or_create makes a second delivery harmless.
    invoice, _ = Invoice.objects.get_or_create(
        order=order, defaults={"number": f"INV-{order.number}", "amount": order.total}
    )
    return {"invoice": invoice.number}


# --- request/reply ---------------------------------------------------------------------

PRICES = {"tea": Decimal("4.50"), "coffee": Decimal("6.00")}


@django_dbqueue.handler("quotes")
def quote(message):
    sku, quantity = message.payload["sku"], message.payload["quantity"]
    if sku not in PRICES:
        raise django_dbqueue.Reject(f"unknown product {sku!r}")
    django_dbqueue.reply(message, {"sku": sku, "quantity": quantity, "total": str(PRICES[sku] * quantity)})
