"""Settings of the example shop, read from the environment with django-environ.

``DATABASE_URL`` defaults to a SQLite file next to manage.py, so the demo
runs with no server; ``mysql://`` and ``postgres://`` URLs work unchanged.
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env(DEBUG=(bool, True))
environ.Env.read_env(BASE_DIR / ".env")

SECRET_KEY = env("SECRET_KEY", default="example-shop-not-secret")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

DATABASES = {"default": env.db_url("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["OPTIONS"] = {"timeout": 30, "init_command": "PRAGMA journal_mode=WAL"}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbqueue",
    # The benchmark (manage.py queuebench, docs/benchmarks.md); it needs nothing more.
    "django_dbqueue.contrib.bench",
    # The Spark analytics (manage.py queueanalytics, exportarchive; docs/analytics.md): the
    # commands need the spark extra, Java and a JDBC driver, and say which is missing.
    "django_dbqueue.contrib.spark",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop.urls"
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
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DBQUEUE = {
    "VISIBILITY_TIMEOUT": 60,
    "BACKOFF_BASE": 0.2,
    "QUEUES": {"emails": {"MAX_ATTEMPTS": 2}, "email": {"MAX_ATTEMPTS": 2}},
    # Queue "invoicing" subscribes to "orders" in the Subscription table (migration shop 0002).
    "TOPICS": {"orders": ["email"]},
}

# Unset, django-dbqueue's commands print their own console (a banner, a line per failed message, a
# summary; -v 2 a line per message), as a project without LOGGING for it sees them. Set
# DBQUEUE_LOG_LEVEL (DEBUG, INFO, WARNING...) to send the queue's records to a handler of the
# project's own instead, at that level: the console then stays off (docs/workers.md).
LOG_LEVEL = env("DBQUEUE_LOG_LEVEL", default=None)
if LOG_LEVEL:
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"console": {"class": "logging.StreamHandler", "level": LOG_LEVEL}},
        "loggers": {"django_dbqueue": {"handlers": ["console"], "level": LOG_LEVEL}},
    }
