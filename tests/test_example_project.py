"""The example shop's own tests (example_project/tests), run as its users run them, on this database."""

import os
import subprocess
import sys
from importlib.metadata import entry_points
from urllib.parse import quote

from django.db import connection

from tests.support.processes import ROOT


def example_database_url(tmp_path) -> str:
    """This run's database server, with a database of the example's own (pytest-django adds ``test_``)."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{tmp_path / 'example.sqlite3'}"
    db = connection.settings_dict
    scheme = {"mysql": "mysql", "postgresql": "postgres"}[connection.vendor]
    credentials = quote(db["USER"] or "", safe="") + (f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else "")
    name = f"dbqueue_example{os.environ.get('DBQUEUE_TEST_DB_SUFFIX', '')}"
    return f"{scheme}://{credentials}@{db['HOST'] or 'localhost'}:{db['PORT'] or ''}/{name}"


def test_the_example_projects_tests_pass(tmp_path):
    plugin = []
    if not any(ep.value == "django_dbqueue.testing.pytest_plugin" for ep in entry_points(group="pytest11")):
        plugin = ["-p", "django_dbqueue.testing.pytest_plugin"]  # a source tree installed before the entry point
    env = {**os.environ, "DATABASE_URL": example_database_url(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--create-db", *plugin],
        cwd=ROOT / "example_project",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout, done.stdout
