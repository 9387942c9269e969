"""Settings for the test suite.

``DATABASE_URL`` picks the database (tox sets it per environment); the
default is a SQLite file so the suite runs with no server. Child processes
started by the tests get ``DBQUEUE_TEST_DATABASE_NAME`` and use the test
database of the process that started them.
"""

import os
import tempfile
from importlib.util import find_spec

import django
import environ

env = environ.Env()
suffix = env("DBQUEUE_TEST_DB_SUFFIX", default="")

default = env.db_url(
    "DATABASE_URL", default=f"sqlite:///{os.path.join(tempfile.gettempdir(), 'dbqueue-tests.sqlite3')}"
)
if default["ENGINE"].endswith("sqlite3"):
    default["OPTIONS"] = {
        "timeout": 60,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
    }
    base, ext = os.path.splitext(default["NAME"])
    # A file, not :memory:, so that worker processes share it.
    default["TEST"] = {"NAME": f"{base}-test{suffix}{ext}"}
else:
    default["TEST"] = {"NAME": f"test_{default['NAME']}{suffix}"}
if default["ENGINE"].endswith("mysql"):
    default.setdefault("OPTIONS", {}).update({"charset": "utf8mb4"})
    default["TEST"].update({"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"})

child_database = os.environ.get("DBQUEUE_TEST_DATABASE_NAME")
if child_database:
    default["NAME"] = child_database

# A second alias for the same database, on its own connection: a queue that
# lives "on another database" as far as transactions go (tests of the outbox
# and of topics across databases).
queues = {**default, "TEST": {"MIRROR": "default"}}

# The same database again, which tests/support/proxy.py points at a fault-injecting
# proxy for the tests that cut connections (tests/test_lost_replies.py).
faulty = {**default, "TEST": {"MIRROR": "default"}}

DATABASES = {"default": default, "queues": queues, "faulty": faulty}

# The child processes of a test that cuts their connections (tests/test_pool.py) get its proxy's
# port: their alias "faulty", where the queue "cut-off" lives, goes through the proxy.
if os.environ.get("DBQUEUE_TEST_FAULTY_PORT"):
    from tests.support.proxy import proxied_settings

    DATABASES["faulty"] = proxied_settings(default, int(os.environ["DBQUEUE_TEST_FAULTY_PORT"]))

# The high-availability tests (tox env ha-postgres, tests/test_ha_postgres.py): the default
# database is a failover cluster; DBQUEUE_HA_DIRECT_URL names a second server ("direct"),
# whose queue ha-direct flows while the cluster fails over, and DBQUEUE_PGBOUNCER_URL
# PgBouncer in front of it ("bouncer", the same test database through the pooler).
if os.environ.get("DBQUEUE_HA_DIRECT_URL"):
    direct = env.db_url("DBQUEUE_HA_DIRECT_URL")
    direct["TEST"] = {"NAME": f"test_{direct['NAME']}{suffix}"}
    if child_database:
        direct["NAME"] = direct["TEST"]["NAME"]
    DATABASES["direct"] = direct
    if os.environ.get("DBQUEUE_PGBOUNCER_URL"):
        bouncer = env.db_url("DBQUEUE_PGBOUNCER_URL")
        bouncer["NAME"] = direct["NAME"]
        bouncer["TEST"] = {"MIRROR": "direct"}
        DATABASES["bouncer"] = bouncer

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbqueue",
    "django_dbqueue.contrib.spark",
    "django_dbqueue.contrib.bench",
    "tests.testapp",
]
if django.VERSION < (6, 0) and find_spec("django_tasks") is not None:
    INSTALLED_APPS.append("django_tasks")  # Django 5.2: the Tasks framework's backport
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

DBQUEUE = {
    "BACKOFF_BASE": 0.5,
    "QUEUES": {
        "no-archive": {"ARCHIVE": False},
        "short": {"VISIBILITY_TIMEOUT": 1, "MAX_ATTEMPTS": 2},
        "elsewhere": {"DATABASE": "queues"},
        "cut-off": {"DATABASE": "faulty"},  # a database a test's proxy takes away (tests/test_pool.py)
        "t-retry": {"BACKOFF_BASE": 0},
        "a-outcomes": {"BACKOFF_BASE": 0, "MAX_ATTEMPTS": 2},
        # Flow control (tests/test_flow_control.py, tests/test_flow_processes.py).
        "fc-groups": {"GROUP_CONCURRENCY": 2, "KIND_GROUP_CONCURRENCY": {"solo": 1}},
        "fc-fifo": {"ORDERED": True, "BACKOFF_BASE": 0.2, "BACKOFF_JITTER": 0},
        "fc-rate": {"RATE_LIMIT": "50/s"},
        "fc-rate-group": {"RATE_LIMIT": "5/s per group"},
        "fc-rate-slow": {"RATE_LIMIT": "3/m"},
        # The stateful property test (tests/test_properties.py): every time a multiple of 30 s, no jitter.
        **{
            name: {"BACKOFF_BASE": 30, "BACKOFF_JITTER": 0, "VISIBILITY_TIMEOUT": 60, "MAX_ATTEMPTS": 3, **rules}
            for name, rules in {
                "pp-plain": {},
                "pp-groups": {"GROUP_CONCURRENCY": 2, "KIND_GROUP_CONCURRENCY": {"solo": 1}},
                "pp-fifo": {"ORDERED": True, "MAX_DEFERRALS": 2},
                "pp-rate": {"RATE_LIMIT": "3/m"},
                "pp-rate-group": {"RATE_LIMIT": "2/m per group"},
                "pp-groups-rate": {"GROUP_CONCURRENCY": 1, "RATE_LIMIT": "2/m per group"},
                "pp-fifo-rate": {"ORDERED": True, "RATE_LIMIT": "1/m per group"},
            }.items()
        },
    },
    "TOPICS": {"t-orders": ["t-email", "t-invoicing"], "pp-news": ["pp-fifo", "pp-plain"]},
}

# The high-availability tests' queues on the second server, straight and through PgBouncer.
if "direct" in DATABASES:
    DBQUEUE["QUEUES"]["ha-direct"] = {"DATABASE": "direct"}
if "bouncer" in DATABASES:
    DBQUEUE["QUEUES"]["ha-bouncer"] = {"DATABASE": "bouncer"}

# Schedules for the processes a test starts (runqueueschedules, runqueueworker):
# JSON in DBQUEUE_TEST_SCHEDULES, the way a project writes DBQUEUE["SCHEDULES"].
if os.environ.get("DBQUEUE_TEST_SCHEDULES"):
    import json

    DBQUEUE["SCHEDULES"] = json.loads(os.environ["DBQUEUE_TEST_SCHEDULES"])

# Settings of the DBQUEUE dict for the processes a test starts (tests/test_pool.py): JSON merged into it.
if os.environ.get("DBQUEUE_TEST_SETTINGS"):
    import json

    DBQUEUE.update(json.loads(os.environ["DBQUEUE_TEST_SETTINGS"]))

# Django's Tasks framework (django.tasks, or the django-tasks backport on 5.2),
# served by django-dbqueue; tests/testapp/tasks.py holds the tasks.
TASKS = {
    "default": {
        "BACKEND": "django_dbqueue.tasks.DatabaseQueueBackend",
        "QUEUES": ["t-tasks", "t-other"],
    },
    "retrying": {
        "BACKEND": "django_dbqueue.tasks.DatabaseQueueBackend",
        "QUEUES": ["t-retry"],
        "OPTIONS": {"MAX_ATTEMPTS": 2},
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_dbqueue": {"handlers": ["console"], "level": "WARNING"}},
}

# Processes the metrics tests start count for Prometheus (docs/metrics.md).
if os.environ.get("DBQUEUE_TEST_METRICS"):
    DBQUEUE = {"METRICS": True}
