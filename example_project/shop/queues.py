"""The shop's message handlers, discovered by django-dbqueue at startup."""

import django_dbqueue


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
