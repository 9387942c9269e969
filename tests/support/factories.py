"""factory-boy factories for live and archived messages."""

from datetime import timedelta

import factory
from django.utils import timezone

from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker


class MessageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Message

    queue = "default"
    kind = ""
    payload = factory.Sequence(lambda n: {"n": n})
    headers = factory.LazyFunction(dict)
    created_at = factory.LazyFunction(lambda: timezone.now() - timedelta(seconds=1))
    available_at = factory.LazyAttribute(lambda o: o.created_at)
    first_available_at = factory.LazyAttribute(lambda o: o.available_at)

    class Params:
        scheduled = factory.Trait(available_at=factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1)))


class ArchivedMessageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ArchivedMessage

    message_id = factory.Sequence(lambda n: n + 1)
    queue = "default"
    payload = factory.Sequence(lambda n: {"n": n})
    headers = factory.LazyFunction(dict)
    created_at = factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=5))
    first_available_at = factory.LazyAttribute(lambda o: o.created_at)
    claimed_at = factory.LazyAttribute(lambda o: o.created_at + timedelta(seconds=2))
    finished_at = factory.LazyAttribute(lambda o: o.claimed_at + timedelta(seconds=1))
    attempts = 1
    outcome = Outcome.ACKED

    class Params:
        dead = factory.Trait(
            outcome=Outcome.DEAD, last_error="Traceback (most recent call last):\n  ...\nValueError: boom"
        )


class WorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Worker

    name = factory.Sequence(lambda n: f"host:{1000 + n}:abc{n}")
    hostname = "host"
    pid = factory.Sequence(lambda n: 1000 + n)
    queues = factory.LazyFunction(lambda: ["default"])
    started_at = factory.LazyFunction(timezone.now)
    last_heartbeat_at = factory.LazyFunction(timezone.now)

    class Params:
        stale = factory.Trait(last_heartbeat_at=factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=5)))
