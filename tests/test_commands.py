"""What the management commands share: one ``--database`` argument, one default (DBQUEUE's DATABASE)."""

import pytest
from django.core import checks
from django.core.management import CommandError, call_command, get_commands, load_command_class
from django.db import OperationalError, connection

# Every command that works on one database, with the arguments it cannot run without.
COMMANDS = {
    "reapqueue": [],
    "queuestats": [],
    "exportarchive": ["--out=unused"],
    "queueanalytics": [],
    "queuebench": [],
    "partitionarchive": [],
}


def parse(name: str, *argv: str) -> dict:
    command = load_command_class(get_commands()[name], name)
    return vars(command.create_parser("manage.py", name).parse_args([*COMMANDS[name], *argv]))


@pytest.mark.parametrize("name", COMMANDS)
def test_database_defaults_to_the_queues_database(name, settings):
    assert parse(name)["database"] == "default"
    settings.DBQUEUE = {**settings.DBQUEUE, "DATABASE": "queues"}
    assert parse(name)["database"] == "queues"
    assert parse(name, "--database", "default")["database"] == "default"


@pytest.mark.parametrize("name", COMMANDS)
def test_an_unknown_database_is_refused_before_the_command_runs(name):
    with pytest.raises(CommandError, match="argument --database: --database 'nope' is not in DATABASES"):
        call_command(name, *COMMANDS[name], "--database=nope")


def test_a_broken_dbqueue_setting_leaves_the_parser_working(settings):
    """The system check (E001) names the problem; ``--help`` and parsing must not crash first."""
    settings.DBQUEUE = {"VISIBILITY_TIMEOUT": "soon"}
    assert parse("reapqueue")["database"] == "default"


def transient_error(vendor: str) -> OperationalError:
    """An error each database's worker takes for weather (db.errors.is_transient): a connection lost."""
    if vendor == "mysql":
        return OperationalError(2013, "Lost connection to server at 'handshake' (injected)")
    if vendor == "postgresql":
        return OperationalError("connection failed: server closed the connection unexpectedly (injected)")
    return OperationalError("database is locked (injected)")


@pytest.mark.django_db(transaction=True, databases="__all__")  # the checks reach every database
def test_a_worker_whose_system_checks_cannot_reach_the_database_tries_again_and_starts(monkeypatch, caplog):
    # The fault seen on a Galera node cut off at start: Django's checks of the fields connect, and failed.
    real, calls = checks.run_checks, []

    def flaky(*args, **kwargs):
        calls.append(kwargs.get("databases"))
        if len(calls) < 3:
            raise transient_error(connection.vendor)
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "run_checks", flaky)
    with pytest.raises(SystemExit) as ended:  # the worker's exit status, once its queue is empty
        call_command("runqueueworker", "cmd-checks", until_empty=True, skip_checks=False, verbosity=0)
    assert ended.value.code == 0
    assert len(calls) == 3
    assert caplog.text.count("the system checks on 'default' hit") == 2


@pytest.mark.django_db(transaction=True, databases="__all__")  # the checks reach every database
def test_a_worker_whose_system_checks_fail_for_good_does_not_start(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise OperationalError("no such table: something (injected; not weather)")

    monkeypatch.setattr(checks, "run_checks", broken)
    with pytest.raises(OperationalError, match="not weather"):
        call_command("runqueueworker", "cmd-checks", until_empty=True, skip_checks=False, verbosity=0)
    assert calls == [1]  # a permanent error is not tried again
