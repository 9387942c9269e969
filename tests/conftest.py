from importlib.metadata import entry_points

import pytest
from django.db import connections, transaction
from django.test import TransactionTestCase

from tests.support.proxy import fault_proxy  # noqa: F401  (a fixture: a proxy that cuts connections)
from tests.support.schedules import schedules  # noqa: F401  (a fixture: code declarations made in a test go away)

# Tables that migrate fills once (post_migrate: content types and permissions) and no test changes.
STATIC_TABLES = {"django_content_type", "auth_permission"}


def _empty_tables(self):
    """`TransactionTestCase`'s cleanup after a test, without refilling what no test changes.

    Django's own runs ``flush``: it empties every table (on PostgreSQL by a
    TRUNCATE, which makes new files for every table and index) and then
    refills the content types and permissions, a commit each. That was half
    a second of every test that commits on MariaDB and PostgreSQL, more than
    the test itself for most. Here the tables that tests write are emptied
    by DELETE in one transaction, and the static ones kept.
    """
    for alias in self._databases_names(include_mirrors=False):
        connection = connections[alias]
        names = connection.introspection.django_table_names(only_existing=True, include_views=False)
        tables = sorted(set(names) - STATIC_TABLES)
        qn = connection.ops.quote_name
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            if connection.vendor == "mysql":
                cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
            try:
                for table in tables:  # foreign keys are checked at the commit (deferred) elsewhere
                    cursor.execute(f"DELETE FROM {qn(table)}")
            finally:
                if connection.vendor == "mysql":
                    cursor.execute("SET FOREIGN_KEY_CHECKS = 1")


TransactionTestCase._fixture_teardown = _empty_tables

# The package's pytest plugin comes through its entry point once installed;
# a source tree installed before the entry point existed loads it here.
if not any(ep.value == "django_dbqueue.testing.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["django_dbqueue.testing.pytest_plugin"]


@pytest.fixture
def handler():
    """``handler(queue, kind=None, **options)``: ``@django_dbqueue.handler`` for one test only."""
    from django_dbqueue import handlers

    registered = []

    def register(queue, kind=None, **options):
        registered.append((queue, kind))
        return handlers.handler(queue, kind, **options)

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
