"""The commands' own console: what real ``manage.py`` processes print with and without the project's logging."""

import json
import re
import signal
import sys

import pytest

import django_dbqueue
from django_dbqueue import __version__
from django_dbqueue.worker import ExitStatus
from tests.support.processes import start_command, start_worker

pytestmark = pytest.mark.django_db(transaction=True)

# A project that left logging for django_dbqueue alone (tests/settings.py configures it).
NO_LOGGING = {"DJANGO_SETTINGS_MODULE": "tests.settings_console"}


@pytest.fixture
def connection_vendor():
    """The database server's name as the banner shows it: SQLite, PostgreSQL, MariaDB or MySQL."""
    from django.db import connection

    return connection.display_name


def enqueue_one_of_each():
    """One message acked, one failing with attempts left, one dead; returns their ids."""
    ok = django_dbqueue.enqueue("w-ok", {"n": 1})
    failing = django_dbqueue.enqueue("w-outcomes", {"action": "raise"}, max_attempts=3)
    rejected = django_dbqueue.enqueue("w-outcomes", {"action": "reject"}, kind="refund")
    return ok.pk, failing.pk, rejected.pk


def run_worker(*args, **env):
    worker = start_worker("w-ok", "w-outcomes", "--until-empty", *args, **env)
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == ExitStatus.OK, err
    return out, err


def test_the_worker_speaks_by_default(connection_vendor):
    ok, failing, rejected = enqueue_one_of_each()
    out, err = run_worker(**NO_LOGGING)
    assert out == ""
    lines = err.splitlines()
    # The banner: version, database and vendor, the queues and their handlers, the options.
    assert re.fullmatch(
        rf"\[\d\d:\d\d:\d\d\] django-dbqueue {re.escape(__version__)} worker \S+ \(Django .+\)", lines[0]
    )
    assert re.fullmatch(rf"  database     default \({connection_vendor} [\d.]+\)", lines[1]), lines[1]
    assert lines[2] == "  queues       w-ok        tests.testapp.queues.ok"
    assert lines[3] == "               w-outcomes  tests.testapp.queues.outcomes"
    assert lines[4] == "  concurrency  1, batch size adaptive (1 to 20), schedules off (none), reaper off"
    # At -v 1: failures with their error, no line for the acked message, no traceback.
    assert f"WARNING message {failing} w-outcomes failed in " in err
    # A failed attempt says when its retry runs.
    assert re.search(r"\(attempt 1 of 3, retry in \d+\.\ds\): ValueError: asked to fail: \{'action': 'raise'\}", err)
    assert f"ERROR message {rejected} w-outcomes/refund dead in " in err
    assert "(attempt 1 of 5): not for us" in err
    assert f"message {ok} " not in err
    assert "Traceback" not in err
    # The summary on exit: what it counts by name, and the failed message that waits for its retry.
    assert re.fullmatch(
        r"\[\d\d:\d\d:\d\d\] worker \S+ exits \(OK: queues are empty\): 1 acked, 1 failed, 1 dead in [\d.]+s; "
        r"1 left waiting \(for a delay or a retry's backoff\)",
        lines[-1],
    )


def test_verbosity_2_adds_a_line_per_message_and_the_failures_traceback():
    ok, failing, _ = enqueue_one_of_each()
    _, err = run_worker("-v", "2", **NO_LOGGING)
    assert re.search(rf"\] message {ok} w-ok acked in \d+\.\d{{3}}s \(attempt 1 of 5\)\n", err)
    assert f"WARNING message {failing} w-outcomes failed in " in err
    assert 'raise ValueError(f"asked to fail: {message.payload}")' in err  # the traceback


def test_verbosity_3_tells_each_failure_once():
    _, failing, rejected = enqueue_one_of_each()
    _, err = run_worker("-v", "3", **NO_LOGGING)
    assert len(re.findall(rf"message {failing} (of )?w-outcomes failed", err)) == 1, err
    assert err.count(f"message {rejected} w-outcomes/refund dead in ") == 1, err


def test_verbosity_0_prints_only_errors():
    _, failing, rejected = enqueue_one_of_each()
    _, err = run_worker("-v", "0", **NO_LOGGING)
    assert [line for line in err.splitlines() if line.startswith("[")] == [
        line for line in err.splitlines() if f"ERROR message {rejected} " in line
    ]
    assert f"message {failing} " not in err


def test_the_projects_logging_keeps_control_and_nothing_is_printed_twice():
    """tests/settings.py sends django_dbqueue to a handler of its own, at WARNING."""
    _, failing, rejected = enqueue_one_of_each()
    _, err = run_worker()
    assert err.count(f"message {failing} w-outcomes failed") == 1
    assert err.count(f"message {rejected} w-outcomes/refund dead") == 1
    assert "django-dbqueue" not in err  # the banner is INFO: below the project's level
    assert not re.search(r"^\[\d\d:\d\d:\d\d\]", err, re.MULTILINE)  # not the console's format
    # -v 2 lowers the level for the project's handler: the banner and every line, each once.
    ok, _, _ = enqueue_one_of_each()
    _, err = run_worker("-v", "2")
    assert err.count(f"django-dbqueue {__version__} worker ") == 1
    assert err.count(f"message {ok} w-ok acked") == 1
    assert err.count(" exits (OK: queues are empty)") == 1


def test_a_handler_on_a_child_logger_is_the_projects_logging_and_nothing_is_printed_twice():
    """A project that gives only ``django_dbqueue.messages`` a handler takes the records: the console stays out."""
    _, failing, rejected = enqueue_one_of_each()
    _, err = run_worker(DJANGO_SETTINGS_MODULE="tests.settings_console_child")
    assert err.count(f"message {failing} w-outcomes failed") == 1, err
    assert err.count(f"message {rejected} w-outcomes/refund dead") == 1, err
    assert f"project: message {failing} w-outcomes failed" in err
    assert not re.search(r"^\[\d\d:\d\d:\d\d\]", err, re.MULTILINE)  # not the console's format


def test_json_logs_print_one_object_per_line():
    ok, failing, rejected = enqueue_one_of_each()
    _, err = run_worker("-v", "2", "--json-logs", **NO_LOGGING)
    lines = [json.loads(line) for line in err.splitlines()]
    events = {}
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys()
        events.setdefault(line.get("event"), []).append(line)
    [banner] = events["banner"]
    assert banner["version"] == __version__
    assert banner["database"] == "default"
    assert banner["queues"] == {"w-ok": ["tests.testapp.queues.ok"], "w-outcomes": ["tests.testapp.queues.outcomes"]}
    assert (banner["concurrency"], banner["batch_size"], banner["schedules"], banner["reaper"]) == (
        1,
        "adaptive",
        False,
        False,
    )
    by_id = {line["id"]: line for line in events["message"]}
    assert by_id[ok]["outcome"] == "acked" and by_id[ok]["level"] == "INFO"
    assert by_id[ok]["queue"] == "w-ok" and by_id[ok]["duration"] >= 0
    assert by_id[failing]["outcome"] == "failed" and by_id[failing]["level"] == "WARNING"
    assert by_id[failing]["error"] == "ValueError: asked to fail: {'action': 'raise'}"
    assert "Traceback" in by_id[failing]["traceback"]
    assert by_id[rejected]["outcome"] == "dead" and by_id[rejected]["kind"] == "refund"
    [summary] = events["summary"]
    assert (summary["acked"], summary["failed"], summary["dead"], summary["processed"]) == (1, 1, 1, 3)
    assert summary["waiting"] == 1 and by_id[failing]["retry_in"] > 0
    assert summary["status"] == "OK" and summary["elapsed"] > 0


def test_json_logs_under_the_projects_logging_say_they_are_ignored():
    """tests/settings.py configures django_dbqueue: --json-logs cannot apply, and says so once, first."""
    enqueue_one_of_each()
    _, err = run_worker("--json-logs")
    assert err.count("--json-logs is ignored") == 1
    assert err.startswith("warning: --json-logs is ignored: the project's LOGGING sends django_dbqueue's records")
    _, err = run_worker("--json-logs", **NO_LOGGING)
    assert "is ignored" not in err


def test_queuemetrics_without_prometheus_client_names_what_to_install(monkeypatch):
    """``None`` in sys.modules makes the import fail as a missing package does (it is installed here)."""
    from django.core.management import CommandError, call_command

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(CommandError, match=r"queuemetrics needs prometheus_client: pip install prometheus_client "):
        call_command("queuemetrics", port=9108)


def test_the_scheduler_says_what_it_does(connection_vendor):
    scheduler = start_command("runqueueschedules", "--max-runtime", "0.5", "--json-logs", **NO_LOGGING)
    _, err = scheduler.communicate(timeout=120)
    assert scheduler.returncode == 0, err
    banner, *_, summary = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert banner["event"] == "banner" and banner["message"].startswith(f"django-dbqueue {__version__} scheduler")
    assert banner["vendor"].startswith(connection_vendor)
    assert summary["event"] == "summary" and "stops after" in summary["message"]


def test_the_reaper_says_what_it_does(connection_vendor):
    reaper = start_command("reapqueue", "--loop", "--interval", "0.2", **NO_LOGGING)
    try:
        first = reaper.stderr.readline()  # the banner comes once the signals are handled
    finally:
        reaper.send_signal(signal.SIGTERM)
        reaper.wait(timeout=120)
    err = first + reaper.stderr.read()  # through the same buffer as the first line
    reaper.stdout.close()
    reaper.stderr.close()
    assert reaper.returncode == 0, err
    assert re.match(
        rf"\[[\d:]+\] django-dbqueue \S+ reaper, a pass every 0.2s\n  database     default \({connection_vendor}", err
    )
    assert re.search(r"\] reaper stops after [\d.]+s$", err.rstrip()), err


def test_queuemetrics_says_what_it_serves(connection_vendor):
    pytest.importorskip("prometheus_client")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_command("queuemetrics", "--port", port, **NO_LOGGING)
    try:
        banner = [server.stderr.readline() for _ in range(2)]  # the banner comes once it listens
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    rest = server.stderr.read()
    assert server.stdout.read() == ""  # the address is announced once, by the banner
    server.stdout.close()
    server.stderr.close()
    assert server.returncode == 0, rest
    assert re.fullmatch(rf"\[[\d:]+\] django-dbqueue \S+ metrics on http://127.0.0.1:{port}/metrics\n", banner[0])
    assert banner[1].startswith(f"  database     default ({connection_vendor}")
    assert re.search(r"\] metrics server stops$", rest.rstrip()), rest
