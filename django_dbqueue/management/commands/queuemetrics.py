"""``manage.py queuemetrics --port``: the Prometheus exposition on a port of its own, for workers' hosts."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbqueue.management.arguments import add_database_argument
from django_dbqueue.management.console import add_console_arguments, command_console, log_banner, log_summary
from django_dbqueue.management.stopping import stop_on_signals


class Command(BaseCommand):
    help = (
        "Serve the queue's Prometheus metrics over HTTP: the database's (depth, oldest ready age) and, with "
        "PROMETHEUS_MULTIPROC_DIR set as for the workers, every worker process's counters (docs/metrics.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, required=True, help="The port to listen on.")
        parser.add_argument(
            "--bind",
            "--addr",
            dest="addr",
            default="127.0.0.1",
            metavar="ADDRESS",
            help="The address to listen on (default 127.0.0.1, this host only; 0.0.0.0 for every interface).",
        )
        add_database_argument(parser, "The queue database to read depth and ages from")
        add_console_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            from prometheus_client import start_http_server

            from django_dbqueue.metrics.exposition import build_registry
        except ImportError as exc:
            raise CommandError(
                "queuemetrics needs prometheus_client: pip install prometheus_client "
                f"(the metrics extra of django-dbqueue installs it too) ({exc})"
            ) from exc
        port = options["port"]
        if not 0 < port < 65536:
            raise CommandError(f"--port must be from 1 to 65535, not {port}")
        url = f"http://{options['addr']}:{port}/metrics"
        with command_console(options) as console, stop_on_signals() as stop:
            server, thread = start_http_server(
                port, options["addr"], registry=build_registry(options["database"], own_thread=True)
            )
            if not console.active:  # the banner says it otherwise: once is enough
                self.stdout.write(f"serving metrics on {url}", ending="\n")
                self.stdout.flush()
            log_banner(f"metrics on {url}", options["database"], ["  stop with CONTROL-C or SIGTERM"], url=url)
            stop.wait()
            server.shutdown()
            thread.join()
            log_summary("metrics server stops", url=url)
