"""Names compare exactly: the collation that makes MySQL/MariaDB compare them byte for byte, as Python does.

Queue, kind, key, group, schedule, topic and subscription names are
identities (DESIGN.md, decision 9): "Acme", "acme" and "acme " are three
names. PostgreSQL and SQLite compare text that way already. MySQL and
MariaDB compare a column by its collation, and a server's default one
ignores case (``_ci``) and trailing spaces (``PAD SPACE``): a claim of
queue "emails" took "Emails" messages, a group row "Acme" locked group
"acme" out for ever. The identifier columns therefore carry a binary
collation that also counts trailing spaces (``NO PAD``):

- MariaDB: ``utf8mb4_nopad_bin`` (``utf8mb4_bin`` is PAD SPACE there);
- MySQL 8.0.17 and later: ``utf8mb4_0900_bin``;
- MySQL before 8.0.17 has no NO PAD binary collation for utf8mb4:
  ``utf8mb4_bin``, exact but for trailing spaces.

A collation names its character set, and a column given only a collation
takes that set: so these columns are utf8mb4 whatever the table's or the
database's default (a utf8mb3 database included). utf8mb4 holds every
name Python can pass, and MySQL has no NO PAD binary collation for utf8mb3
at all; comparing a utf8mb4 column with a utf8mb3 one converts the latter,
so joins with other columns still work (docs/databases.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.mysql.base import DatabaseWrapper as MySQLDatabaseWrapper

MARIADB_EXACT = "utf8mb4_nopad_bin"
MYSQL_EXACT = "utf8mb4_0900_bin"
MYSQL_EXACT_SINCE = (8, 0, 17)
MYSQL_OLD_EXACT = "utf8mb4_bin"


def exact_collation(connection: BaseDatabaseWrapper) -> str | None:
    """The collation an identifier column needs to compare exactly on ``connection``'s database; None: none needed.

    Asks the server's version on MySQL/MariaDB (Django caches it per connection).
    """
    if connection.vendor != "mysql":
        return None
    mysql = cast("MySQLDatabaseWrapper", connection)
    if mysql.mysql_is_mariadb:
        return MARIADB_EXACT
    return MYSQL_EXACT if mysql.mysql_version >= MYSQL_EXACT_SINCE else MYSQL_OLD_EXACT


# What the case-insensitive lookups (``icontains``, the admin's search) compare a name by on MySQL/MariaDB:
# they spell them as a plain LIKE, which a binary column would make case-sensitive there alone.
MYSQL_INSENSITIVE = "utf8mb4_general_ci"


def insensitive_collation(connection: BaseDatabaseWrapper) -> str | None:
    """The collation a name column is compared by in ``iexact``/``icontains``/...; None: the database's own way.

    PostgreSQL compares UPPER() of both sides, SQLite's LIKE ignores ASCII
    case; MySQL/MariaDB rely on the column's collation, binary for names.
    """
    return MYSQL_INSENSITIVE if connection.vendor == "mysql" else None
