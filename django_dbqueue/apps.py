from django.apps import AppConfig


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    label = "django_dbqueue"
    verbose_name = "Database queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .handlers import autodiscover
        from .tasks.compat import FRAMEWORK

        autodiscover()
        if FRAMEWORK is not None:
            # So runqueueworker serves the queues of TASKS backends of ours.
            from .tasks import register_task_queues

            register_task_queues()
