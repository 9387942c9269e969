"""PostgreSQL only: notify listening workers when messages are inserted."""

from django.db import migrations


def install(apps, schema_editor):
    from django_dbqueue.vendor import install_notify_trigger

    install_notify_trigger(schema_editor.connection.alias)


def drop(apps, schema_editor):
    from django_dbqueue.vendor import drop_notify_trigger

    drop_notify_trigger(schema_editor.connection.alias)


class Migration(migrations.Migration):
    dependencies = [("django_dbqueue", "0001_initial")]

    operations = [migrations.RunPython(install, drop, elidable=False)]
