"""What the management commands share: one ``--database`` argument, one default (DBQUEUE's DATABASE)."""

import pytest
from django.core.management import CommandError, call_command, get_commands, load_command_class

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
