import os

from django.apps import AppConfig

# Set by the cpu_bound phase for the workers it starts: they register the handler of queuebench.cpu (cpu.py).
CPU_HANDLER_ENVIRONMENT = "DBQUEUE_BENCH_CPU_HANDLER"


class QueueBenchConfig(AppConfig):
    """``manage.py queuebench``: the queue measured against a raw-SQL ceiling on this database."""

    name = "django_dbqueue.contrib.bench"
    label = "dbqueue_bench"
    verbose_name = "Queue benchmark"

    def ready(self) -> None:
        if os.environ.get(CPU_HANDLER_ENVIRONMENT):
            from .cpu import register

            register()
