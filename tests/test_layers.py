"""The package's shape, checked: vendor branches live in db/ only.

The import layers themselves are checked by ``lint-imports`` (the
``[tool.importlinter]`` contract in pyproject.toml, run in the lint env).
"""

import re
from pathlib import Path

import django_dbqueue

PACKAGE = Path(django_dbqueue.__file__).parent

# Where asking "which database is this?" is the point, outside db/:
ALLOWED = {
    # The Spark JDBC URL and driver depend on the database by nature.
    "contrib/spark/jdbc.py",
    # The benchmark's raw-SQL baseline is hand-written per database on purpose: it is the ceiling we measure against.
    "contrib/bench/rawsql.py",
    # Migrations carry their SQL frozen, per database.
    "migrations/0002_notify_trigger.py",
}
VENDOR_TEST = re.compile(r"\.vendor\b|mysql_is_mariadb|\bas_(mysql|postgresql|sqlite)\b")


def test_only_db_branches_on_the_database_vendor():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("db/") or relative in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR_TEST.search(line):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "database-specific code outside django_dbqueue/db/:\n" + "\n".join(offenders)


def test_the_check_finds_what_it_looks_for():
    """The pattern is not vacuous: db/ itself is full of it."""
    hits = [p for p in (PACKAGE / "db").rglob("*.py") if VENDOR_TEST.search(p.read_text())]
    assert len(hits) >= 4
