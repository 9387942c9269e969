import os

from django.apps import AppConfig

# Set by the cpu_bound phase for the workers it starts: they register the handler of queuebench.cpu (cpu.py).
CPU_HANDLER_ENVIRONMENT = "DBQUEUE_BENCH_CPU_HANDLER"
# Set by the async_io phase for the workers it starts: they register the handlers of its queues (io.py).
IO_HANDLER_ENVIRONMENT = "DBQUEUE_BENCH_IO_HANDLERS"


class QueueBenchConfig(AppConfig):
    """``manage.py queuebench``: the queue measured against a raw-SQL ceiling on this database."""

    name = "django_dbqueue.contrib.bench"
    label = "dbqueue_bench"
    verbose_name = "Queue benchmark"

    def ready(self) -> None:
        if os.environ.get(CPU_HANDLER_ENVIRONMENT):
            from .cpu import register

            register()
        if os.environ.get(IO_HANDLER_ENVIRONMENT):
            from .io import register as register_io

            register_io()
