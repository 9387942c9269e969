"""The column type of every name the queue compares: compared exactly on every database.

Queue, kind, key, group, schedule, topic and subscription names are
identities: "Acme", "acme" and "acme " are three names, as in Python.
Django's ``db_collation`` is one string for every database; a name needs
a binary collation on MySQL/MariaDB only, and a different one per server
(`django_dbqueue.db.names.exact_collation`), so the field asks the
connection. Searches (``icontains`` and the other case-insensitive
lookups, as the admin's search box uses) still ignore case everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import lookups
from django.db.models.sql.compiler import SQLCompiler

from ..db.names import exact_collation, insensitive_collation

# The type parameters django-stubs gives a field (what it is set to, what it reads as), filled in by its plugin.
_ST = TypeVar("_ST", contravariant=True)
_GT = TypeVar("_GT", covariant=True)

if TYPE_CHECKING:
    _CharField = models.CharField
else:

    class _CharField(models.CharField):
        """A CharField that can be subscripted as django-stubs' generic ``CharField[_ST, _GT]`` is (no behaviour)."""

        def __class_getitem__(cls, params: object) -> type:
            return cls


class NameField(_CharField[_ST, _GT]):
    """A ``CharField`` whose column compares exactly: binary and NO PAD on MySQL/MariaDB, elsewhere as is."""

    def db_parameters(self, connection: BaseDatabaseWrapper) -> dict[str, Any]:
        params: dict[str, Any] = super().db_parameters(connection)
        if self.db_collation is None:
            params["collation"] = exact_collation(connection)
        return params


class _Insensitive(lookups.Lookup):
    """A case-insensitive lookup on a name: on MySQL/MariaDB, the column compared by a case-insensitive collation."""

    def process_lhs(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, lhs: Any = None) -> tuple[str, Any]:
        sql, params = super().process_lhs(compiler, connection, lhs)
        collation = insensitive_collation(connection)
        if collation is not None:
            sql = f"{sql} COLLATE {connection.ops.quote_name(collation)}"
        return sql, params


@NameField.register_lookup
class NameIExact(_Insensitive, lookups.IExact):
    pass


@NameField.register_lookup
class NameIContains(_Insensitive, lookups.IContains):
    pass


@NameField.register_lookup
class NameIStartsWith(_Insensitive, lookups.IStartsWith):
    pass


@NameField.register_lookup
class NameIEndsWith(_Insensitive, lookups.IEndsWith):
    pass
