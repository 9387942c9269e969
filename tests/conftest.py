from importlib.metadata import entry_points

import pytest

from tests.support.proxy import fault_proxy  # noqa: F401  (a fixture: a proxy that cuts connections)
from tests.support.schedules import schedules  # noqa: F401  (a fixture: code declarations made in a test go away)

# The package's pytest plugin comes through its entry point once installed;
# a source tree installed before the entry point existed loads it here.
if not any(ep.value == "django_dbqueue.testing.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["django_dbqueue.testing.pytest_plugin"]


@pytest.fixture
def handler():
    """``handler(queue, kind=None)``: ``@django_dbqueue.handler`` for one test only."""
    from django_dbqueue import handlers

    registered = []

    def register(queue, kind=None):
        registered.append((queue, kind))
        return handlers.handler(queue, kind)

    yield register
    for queue, kind in registered:
        handlers.unregister(queue, kind)


@pytest.fixture
def archive_and_live_counts():
    """A callable returning (live, archived) row counts: bad input must change neither."""
    from django_dbqueue.models import ArchivedMessage, Message

    return lambda: (Message.objects.count(), ArchivedMessage.objects.count())


@pytest.fixture(scope="session")
def spark():
    """One local Spark (two cores, as on CI) for the whole run: starting the JVM takes seconds."""
    from django_dbqueue.contrib.spark.session import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()
