"""The analytics commands refuse bad input and a missing extra with a clear error, changing nothing."""

import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_dbqueue.models import QueueStat

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("command", "module"), [("queueanalytics", "pyspark"), ("exportarchive", "pyarrow")])
def test_a_missing_extra_is_named(monkeypatch, tmp_path, command, module):
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, module, None)
    args = [f"--out={tmp_path / 'export'}"] if command == "exportarchive" else []
    # queueanalytics lists every missing prerequisite ("PySpark is not installed: ..."); exportarchive names pyarrow.
    with pytest.raises(
        CommandError, match=rf"(?i){module} is not installed[;:] .*pip install 'django-dbqueue\[spark\]'"
    ):
        call_command(command, *args)
    assert not QueueStat.objects.exists()
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since=2026-13-01"], "'2026-13-01' is not a date or datetime"),
        (["--since=2026-02-01", "--until=2026-01-01"], "must be before --until"),
        (["--database=nope"], "--database 'nope' is not in DATABASES"),
        (["--chunk-size=-5"], "invalid positive_int value"),
    ],
)
def test_exportarchive_refuses_bad_arguments(tmp_path, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("exportarchive", f"--out={tmp_path / 'export'}", *args)
    assert not (tmp_path / "export").exists()


@pytest.mark.spark  # it gets as far as writing, which needs pyarrow (the spark extra)
def test_exportarchive_needs_a_directory_it_can_write(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CommandError, match="cannot write to --out"):
        call_command("exportarchive", f"--out={blocker / 'export'}")
