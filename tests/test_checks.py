"""System checks: the DBQUEUE setting (E001) and what the database can do (E002, W001)."""

import pytest
from django.core import checks
from django.db import connection

from django_dbqueue.conf import get_settings
from django_dbqueue.contrib.spark import checks as spark_checks
from django_dbqueue.contrib.spark.conf import spark_jars
from django_dbqueue.db import capabilities
from django_dbqueue.exceptions import ImproperlyConfiguredQueue

# Django's own model checks query SQLite for its JSON support.
pytestmark = pytest.mark.django_db


def ids_and_messages(**kwargs):
    # No databases named: like manage.py check, but without Django's per-alias JSON support
    # query on every alias (the tests' mirror alias 'queues' is not open to these tests).
    kwargs.setdefault("databases", [])
    found = checks.run_checks(include_deployment_checks=False, **kwargs)
    return [(m.id, m.msg) for m in found if m.id and m.id.startswith("django_dbqueue")]


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ([], "DBQUEUE must be a dict, not list"),
        ({"VISIBILITY_TIMOUT": 5}, "unknown key 'VISIBILITY_TIMOUT'; did you mean 'VISIBILITY_TIMEOUT'? (known keys:"),
        ({"VISIBILITY_TIMEOUT": "5"}, "DBQUEUE['VISIBILITY_TIMEOUT'] must be a number, not str"),
        ({"MAX_ATTEMPTS": 0}, "DBQUEUE['MAX_ATTEMPTS'] must be >= 1"),
        ({"MAX_DEFERRALS": -1}, "DBQUEUE['MAX_DEFERRALS'] must be >= 0, not -1"),
        ({"QUEUES": {"q": {"MAX_DEFERRALS": "10"}}}, "DBQUEUE['QUEUES']['q']['MAX_DEFERRALS'] must be an integer"),
        ({"ARCHIVE": "yes"}, "DBQUEUE['ARCHIVE'] must be True or False"),
        ({"BACKOFF_JITTER": 1.5}, "must be between 0 and 1"),
        ({"UNHANDLED": "drop"}, "DBQUEUE['UNHANDLED'] must be one of 'dead', 'keep'"),
        ({"DATABASE": "nope"}, "names no database in DATABASES: 'nope'"),
        ({"HEARTBEAT_INTERVAL": 5, "WORKER_STALE_AFTER": 6}, "more than twice HEARTBEAT_INTERVAL"),
        ({"QUEUES": []}, "DBQUEUE['QUEUES'] must be a dict"),
        ({"QUEUES": {"bad name": {}}}, "bad queue name"),
        ({"QUEUES": {"q": {"REAP_INTERVAL": 1}}}, "DBQUEUE['QUEUES']['q'] has an unknown key 'REAP_INTERVAL'"),
        ({"QUEUES": {"q": {"MAX_ATTEMPT": 1}}}, "unknown key 'MAX_ATTEMPT'; did you mean 'MAX_ATTEMPTS'? (per-queue"),
        ({"QUEUES": {"q": {"MAX_ATTEMPTS": -1}}}, "DBQUEUE['QUEUES']['q']['MAX_ATTEMPTS'] must be >= 1"),
        ({"TOPICS": ["orders"]}, "DBQUEUE['TOPICS'] must be a dict of topic name to a list of queue names"),
        ({"TOPICS": {"bad topic": ["q"]}}, "DBQUEUE['TOPICS'] has a bad topic name: topic name 'bad topic'"),
        ({"TOPICS": {"orders": "email"}}, "DBQUEUE['TOPICS'] topic 'orders' must have a list of queue names, not str"),
        ({"TOPICS": {"orders": ["email", ""]}}, "DBQUEUE['TOPICS'] topic 'orders' has a bad queue name"),
        ({"TOPICS": {"orders": ["email", "email"]}}, "DBQUEUE['TOPICS'] topic 'orders' names a queue twice"),
        ({"QUEUES": {"q": {"TOPICS": {}}}}, "DBQUEUE['QUEUES']['q'] has an unknown key 'TOPICS'"),
        ({"POOLED_DATABASES": ["default"]}, "must be a dict of database aliases, got list"),
        ({"POOLED_DATABASES": {"nope": None}}, "names no database in DATABASES: 'nope'"),
        ({"POOLED_DATABASES": {"default": "queues", "queues": None}}, "which is pooled itself"),
    ],
)
def test_bad_setting_is_an_error_naming_the_key(settings, setting, words):
    settings.DBQUEUE = setting
    found = ids_and_messages()
    assert [i for i, _ in found] == ["django_dbqueue.E001"], found
    assert words in found[0][1]
    with pytest.raises(ImproperlyConfiguredQueue, match="DBQUEUE"):
        get_settings()


@pytest.mark.parametrize(
    ("jars", "words"),
    [
        ("/usr/share/java/postgresql.jar", "DBQUEUE['SPARK_JARS'] must be a list of paths"),
        (["drivers/postgresql.zip"], "lists 'drivers/postgresql.zip', which is not a .jar file"),
        (["a.jar,b.jar"], "must not contain a comma"),
    ],
)
def test_bad_spark_jars_is_an_error_of_the_analytics_app(settings, jars, words):
    """The key belongs to django_dbqueue.contrib.spark, which checks it; the core's settings still load."""
    settings.DBQUEUE = {"SPARK_JARS": jars}
    found = ids_and_messages()
    assert [i for i, _ in found] == ["django_dbqueue.E001"], found
    assert words in found[0][1]
    assert get_settings().defaults.max_attempts >= 1
    with pytest.raises(ImproperlyConfiguredQueue, match="SPARK_JARS"):
        spark_jars()


@pytest.mark.parametrize("name", ["DBQUEUES", "DB_QUEUE", "DBQUEUE_SETTINGS", "DJANGO_DBQUEUE", "DBQEUE"])
def test_a_setting_named_almost_dbqueue_is_a_warning(settings, name):
    setattr(settings, name, {"MAX_ATTEMPTS": 3})
    found = ids_and_messages()
    assert found == [
        ("django_dbqueue.W004", f"the setting {name} is not read by django-dbqueue, whose setting is named DBQUEUE")
    ]


@pytest.mark.parametrize("name", ["QUEUE", "QUEUES", "DEBUG_QUEUE", "DATABASES_EXTRA", "RQ_QUEUES"])
def test_other_settings_with_queue_in_their_name_are_left_alone(settings, name):
    setattr(settings, name, {})
    assert ids_and_messages() == []


def queueanalytics_refusal():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="queueanalytics cannot start Spark") as caught:
        call_command("queueanalytics")
    return str(caught.value)


def test_queueanalytics_names_a_listed_jar_that_is_missing_before_starting_spark(settings, tmp_path):
    jar = tmp_path / "drivers" / "postgresql.jar"
    settings.DBQUEUE = {"SPARK_JARS": [str(jar)]}
    text = queueanalytics_refusal()
    assert f"- the JDBC driver jar {jar} does not exist: DBQUEUE['SPARK_JARS'] lists it" in text


def test_queueanalytics_names_the_package_of_a_missing_default_driver(settings, monkeypatch, tmp_path):
    """The Debian jars are installed here: the database's default jar is pointed at a missing file."""
    from django_dbqueue.contrib.spark import conf as spark_conf

    vendor = connection.vendor
    jar, package = spark_conf.DRIVER_JARS[vendor]
    gone = str(tmp_path / jar.rsplit("/", 1)[-1])
    monkeypatch.setitem(spark_conf.DRIVER_JARS, vendor, (gone, package))
    monkeypatch.setattr(spark_conf, "DEFAULT_JARS", (gone,))
    text = queueanalytics_refusal()
    assert f"- the JDBC driver jar {gone} does not exist: install it (Debian: apt install {package})" in text


def test_queueanalytics_says_java_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    text = queueanalytics_refusal()
    assert f"- Java is not installed (JAVA_HOME ({tmp_path}) has no bin/java): Spark needs Java 17" in text
    assert "default-jre-headless" in text


def test_good_setting_passes(settings):
    settings.DBQUEUE = {"VISIBILITY_TIMEOUT": 30, "QUEUES": {"emails": {"MAX_ATTEMPTS": 9}}}
    assert ids_and_messages() == []
    assert get_settings().for_queue("emails").max_attempts == 9
    assert get_settings().for_queue("emails").visibility_timeout == 30


def test_topics_setting_is_read_as_lists(settings):
    settings.DBQUEUE = {"TOPICS": {"orders": ("email", "invoicing"), "empty": []}}
    assert ids_and_messages() == []
    assert get_settings().topics == {"orders": ["email", "invoicing"], "empty": []}


def test_database_without_skip_locked_is_an_error(monkeypatch):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite is allowed without SKIP LOCKED (its single-writer rule)")
    assert ids_and_messages(databases=["default"]) == []
    # The servers here all have SKIP LOCKED; play an old MySQL/MariaDB (< 8.0.1 / 10.6).
    monkeypatch.setattr(connection.features, "has_select_for_update_skip_locked", False)
    found = ids_and_messages(databases=["default"])
    assert [i for i, _ in found] == ["django_dbqueue.E002"]
    assert "cannot SELECT ... FOR UPDATE SKIP LOCKED" in found[0][1]


def test_repeatable_read_on_mysql_is_a_warning():
    if connection.vendor != "mysql":
        pytest.skip("the isolation-level warning is MySQL's")
    assert not capabilities.runs_repeatable_read("default")  # Django's default: READ COMMITTED
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    try:
        found = ids_and_messages(databases=["default"])
        assert [i for i, _ in found] == ["django_dbqueue.W001"]
        assert "REPEATABLE READ" in found[0][1]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")


def test_a_missing_spark_jar_is_a_warning_where_pyspark_is_installed(settings, tmp_path, monkeypatch):
    present = tmp_path / "present.jar"
    present.write_bytes(b"")
    missing = tmp_path / "missing.jar"
    jars = [str(present), str(missing), "https://repo.example/driver.jar", "local:/opt/spark/jars/driver.jar"]
    settings.DBQUEUE = {"SPARK_JARS": jars}
    # Whether PySpark is installed decides whether the jars matter; play both.
    monkeypatch.setattr(spark_checks.importlib.util, "find_spec", lambda name: object())
    found = ids_and_messages()
    assert [i for i, _ in found] == ["django_dbqueue.W003"]
    assert str(missing) in found[0][1] and str(present) not in found[0][1]
    assert spark_jars() == jars
    monkeypatch.setattr(spark_checks.importlib.util, "find_spec", lambda name: None)
    assert ids_and_messages() == []


def test_the_hints_name_pages_a_wheels_user_can_open(settings):
    """An installed wheel has no docs/: a hint gives the page's address in the repository, and the page exists."""
    from django_dbqueue.checks import DOCS_URL
    from tests.support.processes import ROOT

    settings.DBQUEUE = {"MAX_ATTEMPTS": "three"}
    settings.DBQUEUES = {}
    hints = {
        m.id: m.hint
        for m in checks.run_checks(include_deployment_checks=False, databases=[])
        if m.id in ("django_dbqueue.E001", "django_dbqueue.W004")
    }
    assert set(hints) == {"django_dbqueue.E001", "django_dbqueue.W004"}
    for hint in hints.values():
        assert f"{DOCS_URL}docs/settings.md" in hint
        assert "see docs/" not in hint.lower()
    assert (ROOT / "docs" / "settings.md").is_file()


def test_a_pooled_database_with_options_that_break_in_transaction_pooling_is_a_warning(settings, monkeypatch):
    """W005: behind PgBouncer in transaction pooling, psycopg's prepared statements (server-side
    binding) and Django's server-side cursors belong to a server session the next transaction
    may not get."""
    from django.conf import settings as django_settings

    database = django_settings.DATABASES["faulty"]
    settings.DBQUEUE = {"POOLED_DATABASES": {"faulty": None}}
    monkeypatch.setitem(database, "OPTIONS", {"server_side_binding": True})
    monkeypatch.setitem(database, "DISABLE_SERVER_SIDE_CURSORS", False)
    found = ids_and_messages()
    assert [i for i, _ in found] == ["django_dbqueue.W005", "django_dbqueue.W005"], found
    assert "database 'faulty' is behind a transaction pooler" in found[0][1]
    assert "prepare_threshold" in found[0][1] and "DISABLE_SERVER_SIDE_CURSORS" in found[1][1]
    monkeypatch.setitem(database, "OPTIONS", {"server_side_binding": True, "prepare_threshold": None})
    monkeypatch.setitem(database, "DISABLE_SERVER_SIDE_CURSORS", True)
    assert ids_and_messages() == []
    settings.DBQUEUE = {}  # not declared pooled: nothing to say
    monkeypatch.setitem(database, "OPTIONS", {"server_side_binding": True})
    assert ids_and_messages() == []
