"""The example shop's own tests (example_project/tests), run as its users run them, on this database."""

import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from urllib.parse import quote

import pytest
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


def test_the_demos_printed_commands_work_when_pasted(tmp_path):
    """`tox -e demo` prints how to replay its dead letter and open the admin: pasted as printed, they work.

    Always on SQLite, as `tox -e demo` runs it; the printed commands get no
    DATABASE_URL or settings from this run, only what they say.
    """
    if connection.vendor != "sqlite":
        pytest.skip("the demo runs on SQLite whatever the suite's database: the SQLite run covers it")
    database = tmp_path / "demo.sqlite3"
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{database}", "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for command in (["migrate", "--noinput", "--verbosity", "0"], ["demo"]):
        done = subprocess.run(
            [sys.executable, "manage.py", *command],
            cwd=ROOT / "example_project",
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout
    dead_ids = re.findall(
        r"^Message #(\d+) \(email, order-placed\) waits in the archive as a dead letter", printed, re.M
    )
    assert len(dead_ids) == 1, printed
    assert "archive row" not in printed  # one id per message: the message's
    (runserver,) = re.findall(r"^  (cd .* manage\.py runserver)$", printed, re.M)
    (replay,) = re.findall(r"^  (cd .* manage\.py shell -c .*)$", printed, re.M)
    (process,) = re.findall(r"^and process it: (cd .* --until-empty)$", printed, re.M)
    assert "127.0.0.1:8000/admin/django_dbqueue/deadletter/" in printed
    assert "log in as 'demo', password 'demo'" in printed
    # One line per event: the worker's line for each failure once, no traceback, nothing on stderr.
    (failed,) = re.findall(r"^  message (\d+) email/order-placed failed in .*$", printed, re.M)
    assert failed == dead_ids[0]
    assert len(re.findall(rf"^  message {failed} email/order-placed dead in ", printed, re.M)) == 1
    assert "Traceback" not in printed and not re.search(r"^message ", printed, re.M)
    assert done.stderr == ""

    pasted = {key: value for key, value in env.items() if key not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}

    def paste(command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=pasted, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    assert re.search(rf"^message {dead_ids[0]} replayed as message \d+$", paste(replay), re.M)
    # The worker's own console: its banner, and a summary counting the replayed message.
    worked = paste(process)
    assert re.search(r"^\[[\d:]+\] django-dbqueue \S+ worker ", worked, re.M), worked
    assert re.search(r"\] worker \S+ exits \(OK: queues are empty\): 1 acked, 0 failed, 0 dead in ", worked), worked
    check = (
        "from django.contrib.auth import authenticate; from django.urls import reverse; "
        "from shop.models import EmailSent; "
        'print(authenticate(username="demo", password="demo") is not None, '
        'reverse("admin:django_dbqueue_deadletter_changelist"), '
        'EmailSent.objects.filter(to="cy@example.com").count())'
    )
    shell = runserver.removesuffix("runserver") + "shell -c " + shlex.quote(check)
    assert paste(shell).split()[-3:] == ["True", "/admin/django_dbqueue/deadletter/", "1"]


def test_the_example_projects_queueanalytics_is_the_current_command(tmp_path):
    """Its own manage.py runs the spark app's command, not the core's deprecated stand-in.

    JAVA_HOME points at an empty directory, so the command stops at its check, before Spark.
    """
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'example.sqlite3'}", "JAVA_HOME": str(tmp_path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "queueanalytics"],
        cwd=ROOT / "example_project",
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Deprecated" not in done.stderr and "moved to the app" not in done.stderr
    assert "queueanalytics cannot start Spark" in done.stderr and "Java is not installed" in done.stderr
