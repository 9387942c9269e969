"""Topics: one published message, a copy in every subscribed queue.

This is AMQP's fan-out (copy distribution, non-competing consumers): each
queue subscribed to a topic gets its own copy, and inside each queue
consumers compete as usual. Subscriptions come from the ``TOPICS`` setting
and from the ``Subscription`` table (editable in the admin); a queue named in
both gets one copy.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import sync_to_async

from .conf import database_for, get_settings
from .exceptions import InvalidOption
from .models import Message, Subscription
from .operations import build_message, enqueue_built
from .validation import validate_headers, validate_queue_name, validate_topic_name

logger = logging.getLogger("django_dbqueue")


def _subscription_database(using: str | None) -> str:
    return database_for([], using)


def subscribers(topic: str, *, using: str | None = None) -> list[str]:
    """The queues subscribed to ``topic``, from the setting and the table, sorted.

    ``using`` is the database holding the ``Subscription`` table (default:
    the ``DATABASE`` setting's default).
    """
    validate_topic_name(topic)
    from_setting = get_settings().topics.get(topic, [])
    from_table = (
        Subscription.objects.using(_subscription_database(using)).filter(topic=topic).values_list("queue", flat=True)
    )
    return sorted({*from_setting, *from_table})


def subscribe(topic: str, queue: str, *, using: str | None = None) -> Subscription:
    """Subscribe ``queue`` to ``topic`` in the table (idempotent); returns the row."""
    validate_topic_name(topic)
    validate_queue_name(queue)
    row, _ = Subscription.objects.using(_subscription_database(using)).get_or_create(topic=topic, queue=queue)
    return row


def unsubscribe(topic: str, queue: str, *, using: str | None = None) -> bool:
    """Remove a subscription from the table; False if there was none.

    Subscriptions from the ``TOPICS`` setting are changed in the settings only.
    """
    validate_topic_name(topic)
    validate_queue_name(queue)
    deleted, _ = Subscription.objects.using(_subscription_database(using)).filter(topic=topic, queue=queue).delete()
    return bool(deleted)


def build_copies(
    topic: str, payload: Any, options: dict[str, Any]
) -> tuple[list[tuple[Message, float | None]], str | None]:
    """Validate a publication and build its copies (unsaved), one per subscribed queue.

    Returns the copies with their delays, and the database they go to (None
    when the topic has no subscribers). Raises before anything is written.
    """
    validate_topic_name(topic)
    using = options.get("using")
    queues = subscribers(topic, using=using)
    headers = {**validate_headers(options.get("headers")), "topic": topic}
    copies = [build_message(queue, payload, {**options, "headers": headers}) for queue in queues]
    if not copies:
        # Validate anyway (topic names follow queue names' rules): a bad call fails whether or not anyone listens.
        build_message(topic, payload, options)
        return [], None
    try:
        return copies, database_for(queues, using)
    except InvalidOption as exc:
        raise InvalidOption(
            f"topic {topic!r}: {exc} (one publication is one transaction, so its queues must share a database)"
        ) from None


def publish(topic: str, payload: Any, **options: Any) -> list[Message]:
    """Write one copy of the message to every queue subscribed to ``topic``, in one transaction.

    Takes the options of `enqueue`; each copy's headers
    gain ``"topic": topic``. Returns the copies (a copy whose key was live in
    its queue is that live message); ``[]`` when nobody subscribes.
    """
    copies, using = build_copies(topic, payload, options)
    if using is None:
        logger.debug("published to topic %r, which has no subscribers", topic)
        return []
    messages = enqueue_built(copies, using)
    return messages


async def apublish(topic: str, payload: Any, **options: Any) -> list[Message]:
    """`publish` from async code: `publish` itself, in Django's thread for sync code (as `aenqueue`)."""
    return await sync_to_async(publish, thread_sensitive=True)(topic, payload, **options)
