from django.apps import AppConfig


class QueueBenchConfig(AppConfig):
    """``manage.py queuebench``: the queue measured against a raw-SQL ceiling on this database."""

    name = "django_dbqueue.contrib.bench"
    label = "dbqueue_bench"
    verbose_name = "Queue benchmark"
