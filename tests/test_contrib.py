"""The contrib apps' old homes in the core keep working for one deprecation period, and say where things went."""

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_dbqueue.contrib import spark

pytestmark = pytest.mark.django_db


def test_the_old_analytics_module_forwards_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"moved to django_dbqueue\.contrib\.spark\.enqueue_dataframe"):
        from django_dbqueue.analytics import enqueue_dataframe
    assert enqueue_dataframe is spark.enqueue_dataframe
    import django_dbqueue.analytics as old

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        old.nothing_here  # noqa: B018


@pytest.mark.parametrize("command", ["exportarchive", "queueanalytics"])
def test_a_moved_command_runs_from_the_core_and_warns_without_its_app(command, capsys):
    # Arguments the command itself refuses: proof that the real command ran behind the warning
    # (queueanalytics first asks for PySpark, which the environments without the spark extra lack).
    refused = "must be before --until|PySpark is not installed"
    backwards = ["--since", "2030-01-01", "--until", "2020-01-01"]
    args = [*backwards, "--out", "unused"] if command == "exportarchive" else backwards
    without = [app for app in settings.INSTALLED_APPS if app != "django_dbqueue.contrib.spark"]
    with (
        override_settings(INSTALLED_APPS=without),
        pytest.warns(DeprecationWarning, match=f"manage.py {command} moved to the app 'django_dbqueue.contrib.spark'"),
        pytest.raises(CommandError, match=refused),
    ):
        call_command(command, *args)
    assert "Deprecated: manage.py" in capsys.readouterr().err
    # With the app installed (the suite's settings): the same command, and no warning (warnings are errors here).
    with pytest.raises(CommandError, match=refused):
        call_command(command, *args)
