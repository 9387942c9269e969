"""Held-back messages set aside (docs/flow-control.md, "Held-back messages are set aside").

A column that keeps a set-aside message's own priority while flow control
gives it the largest one, and the index of set-aside messages, which differs
per database (`django_dbqueue.db.sql.aside_index_sql`): partial on
PostgreSQL and SQLite, whole on MySQL/MariaDB. The largest priority is now
flow control's: a live message that has it (possible before, though unlikely)
gets the one below, which keeps its place in the claim order but for messages
of that very priority. Adding a nullable column is instant on MariaDB 10.3+,
MySQL 8 and PostgreSQL 11+; building the index reads the live table once.
"""

from typing import Any

from django.db import migrations, models

from django_dbqueue.db.sql import aside_index_sql
from django_dbqueue.validation import SET_ASIDE_PRIORITY


def create_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("django_dbqueue", "Message")
    model.objects.using(schema_editor.connection.alias).filter(priority=SET_ASIDE_PRIORITY).update(
        priority=SET_ASIDE_PRIORITY - 1
    )
    schema_editor.execute(aside_index_sql(schema_editor.connection, SET_ASIDE_PRIORITY)[0])


def drop_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("django_dbqueue", "Message")
    # Messages set aside get their own priority back first: without the column, nothing would bring them back.
    rows = model.objects.using(schema_editor.connection.alias).filter(held_priority__isnull=False)
    rows.update(priority=models.F("held_priority"), held_priority=None)
    schema_editor.execute(aside_index_sql(schema_editor.connection, SET_ASIDE_PRIORITY)[1])


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbqueue", "0012_worker_pool"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="held_priority",
            field=models.SmallIntegerField(
                blank=True,
                null=True,
                help_text="Set aside by flow control: its own priority, given back when a rule lets it through.",
            ),
        ),
        migrations.RunPython(create_index, drop_index, atomic=False),
    ]
