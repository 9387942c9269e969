"""The test settings with LOGGING for a child of django_dbqueue only (the console's tests)."""

from tests.settings import *  # noqa: F403

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"project": {"format": "project: %(message)s"}},
    "handlers": {"project": {"class": "logging.StreamHandler", "formatter": "project"}},
    "loggers": {"django_dbqueue.messages": {"handlers": ["project"], "level": "WARNING"}},
}
