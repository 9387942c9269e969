from django.apps import AppConfig


class SparkAnalyticsConfig(AppConfig):
    """Queue analytics on Spark: ``queueanalytics``, ``exportarchive``, ``enqueue_dataframe``."""

    name = "django_dbqueue.contrib.spark"
    label = "dbqueue_spark"
    verbose_name = "Queue analytics (Spark)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
