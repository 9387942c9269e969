"""What the benchmark's child processes run: a worker, or the raw protocol, with a no-op or a writing handler.

Children are started as ``python -m django queuebench --role ROLE ...`` so
they load the project's settings like any management command. With
``--report FILE`` a child writes there the CPU time (user + system) it spent
from the start of its work to its end, so start-up counts for neither side.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from django.db import connections

from ... import handlers
from ...models import Message
from ...worker import QueueWorker, WorkerConfig
from .rawsql import WRITE_TABLE, RawProtocol


def noop(message: Message) -> None:
    """The benchmark's handler: all the cost measured is the queue's."""


# The database the writing handler writes to: the one measured (set by run_role).
WRITE_USING = "default"
# The default workers' handler threads (queuebench --peers-concurrency, set by run_role); None: runqueueworker's.
CONCURRENCY: int | None = None


def write(message: Message) -> None:
    """A handler that writes one row, as real jobs do (in autocommit, on the worker thread's connection)."""
    with connections[WRITE_USING].cursor() as cursor:
        cursor.execute(f"INSERT INTO {WRITE_TABLE} (message_id) VALUES (%s)", [message.pk])


def sleep(message: Message) -> None:
    """A handler that waits the payload's ``ms`` milliseconds (the fairness phase's short and long jobs)."""
    time.sleep(message.payload.get("ms", 0) / 1000)


HANDLERS: dict[str, Callable[[Any], None]] = {"noop": noop, "write": write, "sleep": sleep}


def rss_mb() -> float | None:
    """This process's resident memory, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssByTenth:
    """A no-op handler that reads its own process's RSS after each tenth of ``total`` messages.

    The worker measures itself: sampled from outside, a fast worker can drain
    the whole queue between two samples and leave no reading once warm.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.handled = 0
        self.samples: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        with self.lock:
            self.handled += 1
            if self.handled >= self.total * (len(self.samples) + 1) // 10:
                rss = rss_mb()
                if rss is not None:
                    self.samples.append(rss)


# What a role adds to its report beyond the CPU time (the memory role's samples).
REPORTED: dict[str, Any] = {}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def orm_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    run_orm_worker(queue, batch_size, until_empty, max_runtime, HANDLERS[handler])


def run_orm_worker(
    queue: str, batch_size: int, until_empty: bool, max_runtime: float | None, handler: Callable[[Any], None]
) -> None:
    """A worker with the benchmark's batch size and quick polling, running ``handler``."""
    QueueWorker(
        WorkerConfig(
            queues=[queue],
            batch_size=batch_size,
            until_empty=until_empty,
            max_runtime=max_runtime,
            handler=handler,
            poll_interval=0.01,
            max_poll_interval=0.05,
        )
    ).run()


def default_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    """A worker as ``runqueueworker`` starts it with no flags (its own batch size and polling), for the idle phase."""
    QueueWorker(default_config(queue, until_empty, max_runtime, handler=HANDLERS[handler])).run()


def default_config(queue: str, until_empty: bool, max_runtime: float | None, **options: Any) -> WorkerConfig:
    """``runqueueworker``'s configuration with no flags (but the threads of --peers-concurrency, when given)."""
    if CONCURRENCY is not None:
        options["concurrency"] = CONCURRENCY
    return WorkerConfig(queues=[queue], until_empty=until_empty, max_runtime=max_runtime, **options)


def atomic_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    """`default_worker` with its handler registered ``atomic=True``: the job's write commits with its ack."""
    handlers.handler(queue, atomic=True)(HANDLERS[handler])
    QueueWorker(default_config(queue, until_empty, max_runtime)).run()


def memory_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    """An ORM worker over the queue's messages, reporting its RSS after each tenth of them (the memory phase)."""
    sampler = RssByTenth(Message.objects.using(WRITE_USING).filter(queue=queue).count())
    run_orm_worker(queue, batch_size, until_empty, max_runtime, sampler)
    REPORTED["rss_by_tenth_mb"] = sampler.samples


def raw_loop(until_empty: bool, max_runtime: float | None, step: Callable[[RawProtocol, str], bool]) -> None:
    """Run ``step(protocol, worker name)`` until it finds nothing (with ``until_empty``) or the time is up."""
    protocol = RawProtocol()
    name = f"{socket.gethostname()}:{os.getpid()}:raw"
    deadline = time.monotonic() + (max_runtime or 1e9)
    while time.monotonic() < deadline:
        if step(protocol, name):
            continue
        if until_empty:
            break
        time.sleep(0.01)
    connections.close_all()


def raw_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    """The raw claim/ack loop: claim a batch (one transaction), run each, archive and delete them (another)."""
    run = HANDLERS[handler]

    def step(protocol: RawProtocol, name: str) -> bool:
        token, ids = protocol.claim(queue, batch_size, name)
        for pk in ids:
            run(SimpleNamespace(pk=pk))  # the handler reads only the id
        if ids:
            protocol.ack(token, ids)
        return bool(ids)

    raw_loop(until_empty, max_runtime, step)


def raw_txn_worker(
    queue: str, batch_size: int, until_empty: bool = True, max_runtime: float | None = None, handler: str = "noop"
) -> None:
    """The raw loop of one transaction per message: claim, the handler's write, archive, delete, one COMMIT."""
    run = HANDLERS[handler]

    def step(protocol: RawProtocol, name: str) -> bool:
        return protocol.run_one(queue, name, lambda pk: run(SimpleNamespace(pk=pk)))

    raw_loop(until_empty, max_runtime, step)


def run_role(
    role: str,
    queue: str,
    batch_size: int,
    until_empty: bool,
    max_runtime: float | None,
    *,
    database: str = "default",
    handler: str = "noop",
    report: str | None = None,
    concurrency: int | None = None,
) -> None:
    """Run ``role``; with ``report``, write the CPU time of its work there (JSON)."""
    global WRITE_USING, CONCURRENCY
    WRITE_USING, CONCURRENCY = database, concurrency
    started, wall = cpu_seconds(), time.monotonic()
    ROLES[role](queue, batch_size, until_empty, max_runtime, handler)
    if report:
        with open(report, "w") as out:
            usage = {"cpu_seconds": cpu_seconds() - started, "wall_seconds": time.monotonic() - wall}
            json.dump({**usage, **REPORTED}, out)


ROLES = {
    "orm-worker": orm_worker,
    "raw-worker": raw_worker,
    "raw-txn-worker": raw_txn_worker,
    "default-worker": default_worker,
    "atomic-worker": atomic_worker,
    "memory-worker": memory_worker,
}
