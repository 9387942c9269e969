"""The test settings without LOGGING for django_dbqueue: a project that left it alone (the console's tests)."""

from tests.settings import *  # noqa: F403

LOGGING = {"version": 1, "disable_existing_loggers": False}
