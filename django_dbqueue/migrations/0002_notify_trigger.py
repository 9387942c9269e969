"""PostgreSQL only: notify listening workers when messages are inserted.

The SQL is frozen here, not imported from live code: a migration must do
on a fresh install exactly what it did when existing installs ran it.
"""

from django.db import migrations

NOTIFY_TRIGGER_SQL = """
CREATE OR REPLACE FUNCTION dbqueue_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('dbqueue', queue) FROM (SELECT DISTINCT queue FROM new_rows) AS queues;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS dbqueue_notify ON dbqueue_message;
CREATE TRIGGER dbqueue_notify AFTER INSERT ON dbqueue_message
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION dbqueue_notify();
"""
DROP_NOTIFY_TRIGGER_SQL = """
DROP TRIGGER IF EXISTS dbqueue_notify ON dbqueue_message;
DROP FUNCTION IF EXISTS dbqueue_notify();
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(NOTIFY_TRIGGER_SQL)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_NOTIFY_TRIGGER_SQL)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0001_initial")]

    operations = [migrations.RunPython(install, drop, elidable=False)]
