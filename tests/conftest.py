import pytest
from django.db import connection


@pytest.fixture
def vendor() -> str:
    return connection.vendor


@pytest.fixture
def archive_and_live_counts():
    """A callable returning (live, archived) row counts: bad input must change neither."""
    from django_dbqueue.models import ArchivedMessage, Message

    return lambda: (Message.objects.count(), ArchivedMessage.objects.count())
