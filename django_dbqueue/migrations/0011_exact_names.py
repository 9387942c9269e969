"""Names compare exactly: every identifier column becomes a NameField (docs/databases.md, "Names compare exactly").

On MySQL/MariaDB the columns take a binary NO PAD collation, so "Acme",
"acme" and "acme " are three names there too; each table is rebuilt once,
by one ALTER TABLE for all its columns (a primary key, which other tables
may reference, goes through Django's own AlterField, which also converts
the columns that reference it). On PostgreSQL and SQLite, which compare
exactly already, the database is left alone: only the state changes.

Rows that differed only in case or trailing spaces were one name before
and are distinct names after; rows already merged (a key deduplicated
into one message) stay merged. See CHANGELOG.md.
"""

from typing import Any

from django.db import migrations
from django.db.migrations.operations.base import Operation

import django_dbqueue.models.fields


class ExactNames(Operation):
    """Make ``fields`` of ``model_name`` NameFields: where their collation changes, one ALTER TABLE for the table."""

    reduces_to_sql = True
    reversible = True

    def __init__(self, model_name: str, fields: list[tuple[str, Any]]) -> None:
        self.model_name = model_name
        self.fields = fields

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (self.__class__.__name__, [], {"model_name": self.model_name, "fields": self.fields})

    def state_forwards(self, app_label: str, state: Any) -> None:
        for name, field in self.fields:
            state.alter_field(app_label, self.model_name.lower(), name, field, True)

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._alter(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._alter(app_label, schema_editor, from_state, to_state)

    def _alter(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        old_model = from_state.apps.get_model(app_label, self.model_name)
        new_model = to_state.apps.get_model(app_label, self.model_name)
        connection = schema_editor.connection
        if not self.allow_migrate_model(connection.alias, new_model):
            return
        changed = []
        for name, _ in self.fields:
            old, new = old_model._meta.get_field(name), new_model._meta.get_field(name)
            if old.db_parameters(connection).get("collation") != new.db_parameters(connection).get("collation"):
                changed.append((old, new))
        plain = []
        for old, new in changed:
            if new.primary_key or new.unique:
                schema_editor.alter_field(old_model, old, new)
            else:
                plain.append(new)
        if plain:
            # Only MySQL/MariaDB get here (the one place a NameField's collation differs): MODIFY is its syntax.
            # MODIFY keeps the column's indexes; one statement rebuilds the table once for all its columns.
            qn = schema_editor.quote_name
            parts, params = [], []
            for field in plain:
                definition, more = schema_editor.column_sql(new_model, field)
                parts.append(f"MODIFY {qn(field.column)} {definition}")
                params += more
            sql = f"ALTER TABLE {qn(new_model._meta.db_table)} {', '.join(parts)}"
            schema_editor.execute(sql, params or None)

    def describe(self) -> str:
        return f"Compare {', '.join(name for name, _ in self.fields)} of {self.model_name} exactly"

    @property
    def migration_name_fragment(self) -> str:
        return f"exact_names_{self.model_name.lower()}"


NameField = django_dbqueue.models.fields.NameField


class Migration(migrations.Migration):
    dependencies = [
        ("django_dbqueue", "0010_flow_control"),
    ]

    operations = [
        ExactNames(
            "message",
            [
                ("queue", NameField(max_length=64)),
                ("kind", NameField(blank=True, db_default="", default="", max_length=100)),
                ("key", NameField(blank=True, max_length=255, null=True)),
                (
                    "group",
                    NameField(
                        blank=True,
                        db_column="group_key",
                        help_text="Flow control's group (a customer).",
                        max_length=255,
                        null=True,
                    ),
                ),
            ],
        ),
        ExactNames(
            "archivedmessage",
            [
                ("queue", NameField(max_length=64)),
                ("kind", NameField(blank=True, default="", max_length=100)),
                ("key", NameField(blank=True, max_length=255, null=True)),
                ("group", NameField(blank=True, db_column="group_key", max_length=255, null=True)),
            ],
        ),
        ExactNames("flowgroup", [("queue", NameField(max_length=64)), ("name", NameField(max_length=255))]),
        ExactNames(
            "rateslot",
            [
                ("queue", NameField(max_length=64)),
                (
                    "group",
                    NameField(
                        blank=True, db_column="group_key", default="", help_text="'': the queue.", max_length=255
                    ),
                ),
            ],
        ),
        ExactNames("uniquewindow", [("queue", NameField(max_length=64)), ("key", NameField(max_length=255))]),
        ExactNames("queuestate", [("queue", NameField(max_length=64, primary_key=True, serialize=False))]),
        ExactNames("subscription", [("topic", NameField(max_length=64)), ("queue", NameField(max_length=64))]),
        ExactNames(
            "queuestat",
            [("queue", NameField(max_length=64)), ("kind", NameField(blank=True, default="", max_length=100))],
        ),
        ExactNames(
            "schedule",
            [
                ("name", NameField(max_length=100, primary_key=True, serialize=False)),
                ("queue", NameField(blank=True, default="", max_length=64)),
                ("kind", NameField(blank=True, default="", max_length=100)),
            ],
        ),
    ]
