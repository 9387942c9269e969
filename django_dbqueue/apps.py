from django.apps import AppConfig


class DbQueueConfig(AppConfig):
    name = "django_dbqueue"
    label = "django_dbqueue"
    verbose_name = "Database queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.apps import apps

        from . import checks  # noqa: F401  (registers the system checks)
        from .handlers import autodiscover

        if apps.is_installed("django.contrib.admin"):
            from .admin_topics import register

            register()
        autodiscover()
