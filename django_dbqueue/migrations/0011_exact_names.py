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

The reverse gives each column back the collation it had. Most columns
had their table's default one (migrations 0001 to 0010 set none), which
the reverse gives them. A column that had another (set by hand) is
recorded by the forward, before the change, in the table
``dbqueue_collations_before_0011`` (table, column, collation), which the
forward creates only then; the reverse restores such a column from there
and drops the table once it is empty.
"""

from collections.abc import Iterator
from contextlib import contextmanager
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
        self._alter(app_label, schema_editor, from_state, to_state, backwards=False)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._alter(app_label, schema_editor, from_state, to_state, backwards=True)

    def _alter(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any, *, backwards: bool) -> None:
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
        if not changed:
            return
        # Only MySQL/MariaDB get here (the one place a NameField's collation differs).
        table = new_model._meta.db_table
        if not backwards:
            _record(schema_editor, table, [old.column for old, _ in changed])
            self._change(schema_editor, old_model, new_model, changed)
            return
        with _collations(schema_editor, table, [new for _, new in changed]):
            self._change(schema_editor, old_model, new_model, changed)
        _forget(schema_editor, table, [new.column for _, new in changed])

    @staticmethod
    def _change(schema_editor: Any, old_model: Any, new_model: Any, changed: list[tuple[Any, Any]]) -> None:
        """Give the columns of ``changed`` their new field's definition."""
        plain = []
        for old, new in changed:
            if new.primary_key or new.unique:
                schema_editor.alter_field(old_model, old, new)
            else:
                plain.append(new)
        if plain:
            # MODIFY (MySQL's syntax) keeps the column's indexes; one statement rebuilds the table once for all.
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


# The collation a converted column had, when it was not its table's default: (table, column) -> collation.
RECORD = "dbqueue_collations_before_0011"


def _record(schema_editor: Any, table: str, columns: list[str]) -> None:
    """Write down the collation of each of ``columns`` that is not its table's default (a column recorded
    already keeps its first record). The table and its record are made only when there is one."""
    connection = schema_editor.connection
    marks = ", ".join(["%s"] * len(columns))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.column_name, c.collation_name FROM information_schema.columns c "
            "JOIN information_schema.tables t ON t.table_schema = c.table_schema AND t.table_name = c.table_name "
            f"WHERE c.table_schema = DATABASE() AND c.table_name = %s AND c.column_name IN ({marks}) "
            "AND c.collation_name <> t.table_collation",
            [table, *columns],
        )
        own = cursor.fetchall()
    if not own:
        return
    qn = schema_editor.quote_name
    schema_editor.execute(
        f"CREATE TABLE IF NOT EXISTS {qn(RECORD)} (table_name varchar(64) NOT NULL, column_name varchar(64) NOT NULL, "
        "collation_name varchar(64) NOT NULL, PRIMARY KEY (table_name, column_name)) "
        "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    )
    for column, collation in own:
        schema_editor.execute(
            f"INSERT IGNORE INTO {qn(RECORD)} (table_name, column_name, collation_name) VALUES (%s, %s, %s)",
            [table, column, collation],
        )


def _recorded(schema_editor: Any, table: str) -> dict[str, str]:
    """The collations recorded for ``table``'s columns ({} when nothing was recorded)."""
    connection = schema_editor.connection
    if RECORD not in connection.introspection.table_names():
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT column_name, collation_name FROM {schema_editor.quote_name(RECORD)} WHERE table_name = %s", [table]
        )
        return dict(cursor.fetchall())


@contextmanager
def _collations(schema_editor: Any, table: str, fields: list[Any]) -> Iterator[None]:
    """``fields`` (the state's before this migration) with the collation recorded for their column, meanwhile.

    The fields are the migration state's own, so that a foreign key to one
    (the schedule's name) takes the same collation, as MySQL requires.
    """
    recorded = _recorded(schema_editor, table)
    before = [field.db_collation for field in fields]
    try:
        for field in fields:
            field.db_collation = recorded.get(field.column, field.db_collation)
        yield
    finally:
        for field, collation in zip(fields, before, strict=True):
            field.db_collation = collation


def _forget(schema_editor: Any, table: str, columns: list[str]) -> None:
    """Drop the records of ``columns``, restored; and the record table once it is empty."""
    connection = schema_editor.connection
    qn = schema_editor.quote_name
    if RECORD not in connection.introspection.table_names():
        return
    marks = ", ".join(["%s"] * len(columns))
    schema_editor.execute(
        f"DELETE FROM {qn(RECORD)} WHERE table_name = %s AND column_name IN ({marks})", [table, *columns]
    )
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {qn(RECORD)}")
        empty = cursor.fetchone()[0] == 0
    if empty:
        schema_editor.execute(f"DROP TABLE {qn(RECORD)}")


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
