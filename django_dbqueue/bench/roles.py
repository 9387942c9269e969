"""What the benchmark's child processes run: a worker with a no-op handler, or the raw protocol.

Children are started as ``python -m django queuebench --role ROLE ...`` so
they load the project's settings like any management command.
"""

from __future__ import annotations

import os
import socket
import time

from django.db import connections

from ..models import Message
from ..worker import QueueWorker, WorkerConfig
from .rawsql import RawProtocol


def noop(message: Message) -> None:
    """The benchmark's handler: all the cost measured is the queue's."""


def orm_worker(queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None) -> None:
    QueueWorker(
        WorkerConfig(
            queues=[queue],
            batch_size=batch_size,
            until_empty=until_empty,
            max_runtime=max_runtime,
            handler=noop,
            poll_interval=0.01,
            max_poll_interval=0.05,
        )
    ).run()


def raw_worker(queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None) -> None:
    protocol = RawProtocol()
    name = f"{socket.gethostname()}:{os.getpid()}:raw"
    deadline = time.monotonic() + (max_runtime or 1e9)
    while time.monotonic() < deadline:
        token, ids = protocol.claim(queue, batch_size, name)
        if ids:
            for _ in ids:
                noop(None)  # type: ignore[arg-type]
            protocol.ack(token, ids)
        elif until_empty:
            break
        else:
            time.sleep(0.01)
    connections.close_all()


ROLES = {"orm-worker": orm_worker, "raw-worker": raw_worker}
