from importlib.util import find_spec

from django.apps import AppConfig

from .conf import raw_setting


def wanted(key: str, package: str) -> bool:
    """``DBQUEUE[key]`` is True and ``package`` is installed (checks E004/E005 report it missing)."""
    raw = raw_setting()
    return isinstance(raw, dict) and raw.get(key) is True and find_spec(package) is not None


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    label = "django_dbqueue"
    verbose_name = "Database queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .handlers import autodiscover
        from .tasks.compat import FRAMEWORK
        from .testing.immediate import follow_setting

        autodiscover()
        follow_setting()  # DBQUEUE["MODE"] = "immediate" (docs/testing.md)
        if wanted("METRICS", "prometheus_client"):
            from . import metrics

            metrics.enable()
        if wanted("TRACING", "opentelemetry"):
            from . import tracing

            tracing.enable()
        if FRAMEWORK is not None:
            # So runqueueworker serves the queues of TASKS backends of ours.
            from .tasks import register_task_queues

            register_task_queues()
