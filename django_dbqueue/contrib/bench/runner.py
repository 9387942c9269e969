"""The benchmark phases, each measured against the raw-SQL protocol in the same run.

Rates are computed from the database's own timestamps where processes are
involved (first claim to last finish in the archive), so process start-up
is not counted against either side. Every phase works on queues named
``queuebench.*`` and removes its rows before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, TextIO

from django.conf import settings
from django.core.management.base import OutputWrapper
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Max, Min
from django.test.utils import override_settings

from ...conf import database_for, get_settings
from ...db import vendor
from ...db.stats import refresh_statistics
from ...management.arguments import cpu_count
from ...models import ArchivedMessage, FlowGroup, Message, WorkflowEdge, WorkflowRun, WorkflowStep
from ...operations import ack_many, build_message, claim, enqueue, enqueue_many
from ...reaper import Reaper
from ...workflows import Step, Workflow
from .apps import CPU_HANDLER_ENVIRONMENT, IO_HANDLER_ENVIRONMENT
from .cpu import QUEUE as CPU_QUEUE
from .cpu import rounds_for
from .io import ASYNC_QUEUE as IO_ASYNC_QUEUE
from .io import SYNC_QUEUE as IO_SYNC_QUEUE
from .rawsql import RawProtocol, count_written, create_write_table, drop_write_table, named_from, table_size

PHASES = (
    "enqueue",
    "enqueue_many",
    "drain",
    "drain_write",
    "per_message",
    "peers",
    "drain_groups",
    "latency",
    "claim_latency",
    "memory",
    "admin_list",
    "admin_workflows",
    "cpu_bound",
    "soak",
    "idle",
    "async_io",
    "workflows",
    "archive",
    "fairness",
    "sigkill",
)
# Phases run only when asked for (--phases): they take minutes at their default sizes, or long waits.
OPT_IN_PHASES = ("soak", "idle", "async_io", "workflows", "admin_workflows", "archive", "fairness", "sigkill")
DEFAULT_PHASES = tuple(phase for phase in PHASES if phase not in OPT_IN_PHASES)
PREFIX = "queuebench."
GROUPS_QUEUE = PREFIX + "groups"
GROUPS = 1000
CPU_MS = 20.0  # the cpu_bound phase's handler: milliseconds of pure Python per message
CPU_THREADS, CPU_PROCESSES = 4, 2
CPU_BASELINE = f"one runqueueworker process with --concurrency {CPU_THREADS}"
IO_MS = 100.0  # the async_io phase's handlers: milliseconds of simulated I/O per message
IO_THREADS, IO_PROCESSES, IO_ASYNC = 8, 2, 500  # --concurrency, --processes, --async-concurrency
IO_BASELINE = f"one runqueueworker process with --concurrency {IO_THREADS} (time.sleep)"
WORKFLOW_QUEUE = PREFIX + "workflow"
CHAIN_STEPS = 1000  # the workflows phase's chain (at most --messages)
FAIRNESS_SHORT_MS, FAIRNESS_LONG_MS, FAIRNESS_EVERY = 1, 2000, 100  # a 2 s job among every 100 of 1 ms
SIGKILL_MESSAGES = 3000  # the sigkill phase: one-row jobs, the worker killed a third of the way through
JOIN_SAMPLES = 200  # the workflows phase's small fan-ins whose joins' waits give its p99 (at most --messages)


@dataclass
class BenchConfig:
    messages: int = 10_000
    workers: int = 4
    batch_size: int = 10
    payload_bytes: int = 100
    database: str = "default"
    phases: tuple[str, ...] = DEFAULT_PHASES
    rate: int = 200  # offered load of the latency phase, messages per second
    latency_seconds: float = 10.0
    archive_rows: int = 100_000
    scheduled: int = 10_000
    memory_messages: int = 100_000
    per_message_messages: int = 2_000
    peers_messages: int = 5_000  # the peers phase: as many jobs as the comparison with other queues drained
    peers_concurrency: int | None = None  # the peers phase's default workers' threads; None: runqueueworker's
    fairness_messages: int = 400  # the fairness phase: a 2 s job among every 100 of 1 ms
    repeat: int = 1
    soak_messages: int = 1_000_000
    idle_seconds: float = 10.0
    cpu_messages: int = 400  # the cpu_bound phase: messages of CPU_MS each
    io_messages: int = 2_000  # the async_io phase: messages of IO_MS each
    nudges: bool = True  # False: workers wait for their poll only (MySQL/MariaDB, SQLite)
    history_rows: int = 1_000_000  # the archive phase: archived rows over history_days days
    history_days: int = 60


@dataclass
class Result:
    phase: str
    ours: float
    unit: str
    baseline: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    runs: int = 1
    ratio_median: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.ratio_median is not None:
            return self.ratio_median
        return self.ours / self.baseline if self.baseline else None


def median_result(results: list[Result]) -> Result:
    """One result from several runs of a phase: medians, with every run's extras kept."""
    first = results[0]
    if len(results) == 1:
        return first
    baselines = [r.baseline for r in results if r.baseline is not None]
    ratios = [r.ratio for r in results if r.ratio is not None]
    extra = {
        key: statistics.median(r.extra[key] for r in results)
        for key, value in first.extra.items()
        if isinstance(value, int | float) and all(key in r.extra for r in results)
    }
    extra["runs"] = [r.extra for r in results]
    return Result(
        first.phase,
        statistics.median(r.ours for r in results),
        first.unit,
        statistics.median(baselines) if baselines else None,
        extra,
        runs=len(results),
        ratio_median=statistics.median(ratios) if ratios else None,
    )


@contextlib.contextmanager
def bench_queues_on(database: str, nudges: bool = True) -> Iterator[None]:
    """Route the benchmark's queues to ``database``, and turn nudges off if asked (children get both too)."""
    raw = dict(getattr(settings, "DBQUEUE", {}))
    queues = dict(raw.get("QUEUES", {}))
    # The drain_groups phase: at most one message of a group in flight (docs/flow-control.md).
    queues[GROUPS_QUEUE] = {**queues.get(GROUPS_QUEUE, {}), "GROUP_CONCURRENCY": 1}
    # An attempt that fails on weather (an atomic handler's transaction that deadlocked) runs again at
    # once: a retry waiting out its backoff is not ready, and the drain's --until-empty workers would
    # stop before it, one message short.
    for name in (PREFIX + "drain", GROUPS_QUEUE):
        queues[name] = {**queues.get(name, {}), "BACKOFF_BASE": 0}
    if database != "default":
        names = (
            "enqueue",
            "enqueue_many",
            "drain",
            "groups",
            "latency",
            "claim",
            "memory",
            "soak",
            "soak-probe",
            "idle",
        )
        for name in names:
            queues[PREFIX + name] = {**queues.get(PREFIX + name, {}), "DATABASE": database}
    raw["QUEUES"] = queues
    if not nudges:
        raw["NUDGE_HOST"] = None
    with override_settings(DBQUEUE=raw):
        yield


def spawn(
    role: str, queue: str, config: BenchConfig, *extra: str, batch_size: int | None = None
) -> subprocess.Popen[bytes]:
    """A child process running ``role`` (see `roles`) with this process's settings."""
    command = [sys.executable, "-m", "django", "queuebench", "--role", role, "--queue", queue]
    command += ["--batch-size", str(batch_size or config.batch_size), "--database", config.database, *extra]
    if not config.nudges:
        command.append("--no-nudges")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.setdefault("DJANGO_SETTINGS_MODULE", os.environ.get("DJANGO_SETTINGS_MODULE", ""))
    return subprocess.Popen(command, env=env)


def tree_rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` and its descendants, in MB, from /proc (0 where it cannot be read)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as statm:
                rss[int(entry)] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += rss.get(current, 0.0)
        todo += children.get(current, [])
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class QueueBench:
    def __init__(self, config: BenchConfig, progress: TextIO | OutputWrapper = sys.stderr) -> None:
        self.config = config
        self.progress = progress
        self.payload = {"data": "x" * max(0, config.payload_bytes - 12)}
        self.using = config.database

    def say(self, text: str) -> None:
        self.progress.write(f"[queuebench] {text}\n")
        self.progress.flush()

    def run(self) -> list[Result]:
        """Every phase ``repeat`` times; each figure is the median of the runs (ratios: of per-run ratios)."""
        runs: dict[str, list[Result]] = {}
        with bench_queues_on(self.using, self.config.nudges):
            for number in range(1, self.config.repeat + 1):
                for phase in self.config.phases:
                    self.say(f"{phase} (run {number} of {self.config.repeat}) ...")
                    self.clean()
                    try:
                        for result in getattr(self, f"phase_{phase}")():
                            runs.setdefault(result.phase, []).append(result)
                            self.say(f"{result.phase}: {result.ours:,.1f} {result.unit}")
                    finally:
                        self.clean()
        return [median_result(results) for results in runs.values()]

    def clean(self) -> None:
        for model in (Message, ArchivedMessage):
            named_from(model.objects.using(self.using), PREFIX)._raw_delete(self.using)
        named_from(FlowGroup.objects.using(self.using), PREFIX).delete()
        drop_write_table(self.using)

    def timed(self, action: Callable[[], Any]) -> float:
        started = time.perf_counter()
        action()
        return time.perf_counter() - started

    def producing(self, phase: str, count: int, raw: Callable[[], Any], ours: Callable[[], Any]) -> Result:
        """A producer phase, run in this process: the raw statements, then ours on emptied tables.

        Besides the rates, this process's CPU time per message on each side
        (the driver's and Python's work, not the server's), which wall time
        on a shared machine hides: the gap a producer's own code makes.
        """
        cpu = time.process_time()
        baseline = count / self.timed(raw)
        raw_cpu = (time.process_time() - cpu) / count * 1e6
        self.clean()
        cpu = time.process_time()
        rate = count / self.timed(ours)
        our_cpu = (time.process_time() - cpu) / count * 1e6
        extra = {
            "messages": count,
            "cpu_us_per_message": our_cpu,
            "raw_cpu_us_per_message": raw_cpu,
            "cpu_ratio": our_cpu / raw_cpu if raw_cpu else 0.0,
        }
        return Result(phase, rate, "messages/s", baseline, extra)

    # --- phases ----------------------------------------------------------------

    def phase_enqueue(self) -> list[Result]:
        count = min(self.config.messages, 2000)
        queue = PREFIX + "enqueue"
        raw = RawProtocol(self.using)
        return [
            self.producing(
                "enqueue (one at a time)",
                count,
                lambda: raw.insert_many(queue, [self.payload] * count, one_by_one=True),
                lambda: [enqueue(queue, self.payload, using=self.using) for _ in range(count)],
            )
        ]

    def phase_enqueue_many(self) -> list[Result]:
        count = self.config.messages
        queue = PREFIX + "enqueue_many"
        raw = RawProtocol(self.using)
        return [
            self.producing(
                "enqueue_many",
                count,
                lambda: raw.insert_many(queue, [self.payload] * count),
                lambda: enqueue_many(queue, [self.payload] * count, using=self.using),
            )
        ]

    def _drain(
        self,
        role: str,
        *,
        workers: int,
        batch_size: int,
        messages: int,
        handler: str = "noop",
        groups: int = 0,
        options: tuple[str, ...] = (),
    ) -> tuple[float, float]:
        """``workers`` children of ``role`` drain ``messages``: messages/s, and their CPU milliseconds per message.

        The rate is from the database's timestamps (first claim to last
        finish); the CPU time is what the children spent from the start of
        their work to its end (user + system), as they report it.
        """
        queue = GROUPS_QUEUE if groups else PREFIX + "drain"
        self.clean()
        self.fill(queue, messages, groups)
        if handler == "write":
            create_write_table(self.using)
        with tempfile.TemporaryDirectory(prefix="queuebench-") as reports:
            paths = [os.path.join(reports, f"{n}.json") for n in range(workers)]
            extra = ("--handler", handler, *options)
            children = [
                spawn(role, queue, self.config, *extra, "--report", path, batch_size=batch_size) for path in paths
            ]
            for child in children:
                if child.wait(timeout=3600) != 0:
                    raise RuntimeError(f"a {role} child exited with {child.returncode}")
            cpu = 0.0
            for path in paths:
                with open(path) as report:
                    cpu += json.load(report)["cpu_seconds"]
        archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
        done = archive.count()
        if done != messages:
            raise RuntimeError(f"{role}: {done} of {messages} messages drained")
        if handler == "write":
            written = count_written(self.using)
            drop_write_table(self.using)
            if written < messages:
                raise RuntimeError(f"{role}: the handler wrote {written} rows for {messages} messages")
        span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
        return done / max((span["last"] - span["first"]).total_seconds(), 1e-6), cpu * 1000 / done

    def _drain_phase(self, name: str, *, workers: int, batch_size: int, messages: int, handler: str) -> Result:
        sizes: dict[str, Any] = {"workers": workers, "batch_size": batch_size, "messages": messages, "handler": handler}
        baseline, raw_cpu = self._drain("raw-worker", **sizes)
        ours, our_cpu = self._drain("orm-worker", **sizes)
        extra = {
            **sizes,
            "cpu_ms_per_message": our_cpu,
            "raw_cpu_ms_per_message": raw_cpu,
            "cpu_ratio": our_cpu / raw_cpu if raw_cpu else 0.0,
            "ms_per_message": 1000 / ours,
            "raw_ms_per_message": 1000 / baseline,
        }
        return Result(name, ours, "messages/s", baseline, extra)

    def phase_drain(self) -> list[Result]:
        """W worker processes with a no-op handler, batches of B, against W raw loops."""
        workers, batch = self.config.workers, self.config.batch_size
        name = f"drain ({workers} worker processes, batch {batch})"
        return [
            self._drain_phase(name, workers=workers, batch_size=batch, messages=self.config.messages, handler="noop")
        ]

    def phase_drain_write(self) -> list[Result]:
        """As ``drain``, with a handler that inserts one row per message, as real jobs write."""
        workers, batch = self.config.workers, self.config.batch_size
        name = f"drain_write ({workers} worker processes, batch {batch})"
        return [
            self._drain_phase(name, workers=workers, batch_size=batch, messages=self.config.messages, handler="write")
        ]

    def phase_drain_groups(self) -> list[Result]:
        """The drain with every message in one of 1,000 groups, at most one of a group in flight, against the drain
        of the same messages in no group (both our workers; the ratio is the cost of the group limit)."""
        workers, batch, messages = self.config.workers, self.config.batch_size, self.config.messages
        sizes: dict[str, Any] = {"workers": workers, "batch_size": batch, "messages": messages}
        plain, plain_cpu = self._drain("orm-worker", **sizes)
        grouped, grouped_cpu = self._drain("orm-worker", **sizes, groups=GROUPS)
        extra = {
            **sizes,
            "groups": GROUPS,
            "group_concurrency": 1,
            "baseline": "the same drain, messages in no group",
            "grouped_cpu_ms_per_message": grouped_cpu,
            "ungrouped_cpu_ms_per_message": plain_cpu,
        }
        name = f"drain_groups ({GROUPS:,} groups, limit 1; {workers} workers, batch {batch})"
        return [Result(name, grouped, "messages/s", plain, extra)]

    def phase_per_message(self) -> list[Result]:
        """One worker as ``runqueueworker`` runs by default (one thread, batch 1) against the raw per-message loop."""
        messages = self.config.per_message_messages
        name = "per_message (1 default worker)"
        return [self._drain_phase(name, workers=1, batch_size=1, messages=messages, handler="noop")]

    def phase_peers(self) -> list[Result]:
        """``runqueueworker`` with no flags, 1 and W processes, jobs that write one row each, against the loop a
        user writes by hand: one transaction per message (claim, the job's row, archive, delete, one COMMIT).

        The shape of the comparison with other queues (docs/benchmarks.md,
        "Against other queues"): their defaults against ours.
        """
        messages = self.config.peers_messages
        results = []
        for workers in sorted({1, self.config.workers}):
            sizes: dict[str, Any] = {"workers": workers, "messages": messages, "handler": "write"}
            baseline, raw_cpu = self._drain("raw-txn-worker", batch_size=1, **sizes)
            # The handler registered atomic=True: its row and its ack in one transaction, as the raw loop's.
            threads = self.config.peers_concurrency
            options = ("--concurrency", str(threads)) if threads else ()
            for role, how in (("default-worker", ""), ("atomic-worker", ", atomic handler")):
                ours, our_cpu = self._drain(role, batch_size=1, options=options, **sizes)
                extra = {
                    **sizes,
                    "batch_size": "runqueueworker's default",
                    "concurrency": threads or "runqueueworker's default",
                    "cpu_ms_per_message": our_cpu,
                    "raw_cpu_ms_per_message": raw_cpu,
                    "cpu_ratio": our_cpu / raw_cpu if raw_cpu else 0.0,
                    "ms_per_message": 1000 / ours,
                    "raw_ms_per_message": 1000 / baseline,
                }
                if threads:
                    how += f", --concurrency {threads}"
                name = f"peers ({workers} default worker{'s' if workers > 1 else ''}, one-row jobs{how})"
                results.append(Result(name, ours, "messages/s", baseline, extra))
        return results

    def _run_until_empty(self, queue: str, role: str, workers: int, batch_size: int, handler: str) -> None:
        """``workers`` children of ``role`` drain ``queue`` and exit."""
        children = [
            spawn(role, queue, self.config, "--handler", handler, batch_size=batch_size) for _ in range(workers)
        ]
        for child in children:
            if child.wait(timeout=3600) != 0:
                raise RuntimeError(f"a {role} child exited with {child.returncode}")

    def phase_fairness(self) -> list[Result]:
        """Mixed jobs, one of 2 s among every 100 of 1 ms, drained by W workers: the default (adaptive) against
        ``--batch-size 1`` and a fixed ``--batch-size 20``.

        How long a worker held each short job before it finished (the
        archive's finished_at - claimed_at, the last claim's): a short job
        claimed behind a long one is held until the long one ends, unless it
        is given back. Also the seconds from the first claim to the last finish,
        and, before each, the rate of as many 1 ms jobs alone.
        """
        queue = PREFIX + "drain"
        messages, workers = max(self.config.fairness_messages, FAIRNESS_EVERY), self.config.workers
        payloads = [
            {"ms": FAIRNESS_LONG_MS if n % FAIRNESS_EVERY == FAIRNESS_EVERY // 2 else FAIRNESS_SHORT_MS}
            for n in range(messages)
        ]
        runs: dict[str, dict[str, float]] = {}
        for label, role, batch in (
            ("adaptive", "default-worker", 1),
            ("batch 1", "orm-worker", 1),
            ("batch 20", "orm-worker", 20),
        ):
            # First the same number of 1 ms jobs alone: the throughput a batch buys on short handlers.
            self.clean()
            enqueue_many(queue, [{"ms": FAIRNESS_SHORT_MS}] * messages, using=self.using)
            self._run_until_empty(queue, role, workers, batch, "sleep")
            archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
            span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
            short_rate = archive.count() / max((span["last"] - span["first"]).total_seconds(), 1e-6)
            self.clean()
            enqueue_many(queue, payloads, using=self.using)
            self._run_until_empty(queue, role, workers, batch, "sleep")
            archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
            if archive.count() != messages:
                raise RuntimeError(f"fairness ({label}): {archive.count()} of {messages} messages drained")
            held = sorted(
                (finished - claimed).total_seconds() * 1000
                for claimed, finished, payload in archive.values_list("claimed_at", "finished_at", "payload")
                if payload["ms"] == FAIRNESS_SHORT_MS and claimed is not None
            )
            span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
            runs[label] = {
                "short_only_per_second": short_rate,
                "seconds": (span["last"] - span["first"]).total_seconds(),
                "short_held_p99_ms": held[max(0, int(len(held) * 0.99) - 1)],
                "short_held_max_ms": held[-1],
                "short_held_over_1s": sum(ms > 1000 for ms in held),
            }
        extra = {"workers": workers, "messages": messages, **runs}
        name = f"fairness ({workers} workers, a 2 s job per 100 of 1 ms), short jobs held, max ms"
        ours, baseline = runs["adaptive"]["short_held_max_ms"], runs["batch 1"]["short_held_max_ms"]
        return [Result(name, ours, "ms", baseline, extra)]

    def phase_sigkill(self) -> list[Result]:
        """One worker draining one-row jobs, killed (SIGKILL) a third of the way through; the reaper gives its
        messages back and a second worker drains the rest. How many jobs ran twice (rows written twice), and
        how many lost an attempt without running twice: the default (adaptive) against ``--batch-size 1``, and
        the default with the job registered ``atomic=True`` (its row written with its ack: never twice)."""
        queue = PREFIX + "drain"
        messages = min(SIGKILL_MESSAGES, self.config.messages)
        counts: dict[str, dict[str, int]] = {}
        runs = (("adaptive", "default-worker", 1), ("batch 1", "orm-worker", 1), ("atomic", "atomic-worker", 1))
        for label, role, batch in runs:
            self.clean()
            self.fill(queue, messages)
            create_write_table(self.using)
            archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
            victim = spawn(role, queue, self.config, "--handler", "write", batch_size=batch)
            deadline = time.monotonic() + 300
            while count_written(self.using) < messages // 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            victim.kill()
            victim.wait(timeout=60)
            held = Message.objects.using(self.using).filter(queue=queue, lease_token__isnull=False).count()
            time.sleep(get_settings().worker_stale_after + 1)
            Reaper(using=self.using).run_once()
            self._run_until_empty(queue, role, 1, batch, "write")
            written = count_written(self.using)
            if archive.count() != messages or written < messages:
                raise RuntimeError(f"sigkill ({label}): {archive.count()} archived, {written} written of {messages}")
            twice = written - messages
            counted = archive.filter(attempts__gt=1).count()
            counts[label] = {"held_at_kill": held, "ran_twice": twice, "attempt_lost_unrun": counted - twice}
            drop_write_table(self.using)
        extra = {"messages": messages, **counts}
        name = "sigkill (1 worker killed mid-drain), jobs run twice"
        return [Result(name, counts["adaptive"]["ran_twice"], "jobs", counts["batch 1"]["ran_twice"], extra)]

    def phase_latency(self) -> list[Result]:
        """Enqueue at a fixed rate while workers run; latency = claim time - enqueue time.

        The workers are as ``runqueueworker`` starts them with no flags (their
        own polling): the wait a user gets, nudges included where they apply.
        """
        queue = PREFIX + "latency"
        runtime = str(self.config.latency_seconds + 60)
        workers = [
            spawn("default-worker", queue, self.config, "--forever", "--max-runtime", runtime)
            for _ in range(self.config.workers)
        ]
        time.sleep(3)  # let them start and settle into polling
        total = int(self.config.rate * self.config.latency_seconds)
        interval = 1 / self.config.rate
        started = time.perf_counter()
        for n in range(total):
            time.sleep(max(0.0, started + n * interval - time.perf_counter()))
            enqueue(queue, self.payload, using=self.using)
        archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
        deadline = time.monotonic() + 120
        while archive.count() < total and time.monotonic() < deadline:
            time.sleep(0.2)
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(timeout=120)
        waits = [(c - e).total_seconds() * 1000 for e, c in archive.values_list("created_at", "claimed_at") if c]
        if len(waits) != total:
            raise RuntimeError(f"latency: {len(waits)} of {total} messages processed")
        extra = {
            "p50_ms": percentile(waits, 50),
            "p95_ms": percentile(waits, 95),
            "p99_ms": percentile(waits, 99),
            "offered_rate": self.config.rate,
            "messages": total,
            "nudges": self.config.nudges,
        }
        return [Result(f"end-to-end latency p50 at {self.config.rate}/s", extra["p50_ms"], "ms", None, extra)]

    def _claim_ack_ms(self, queue: str, rounds: int = 300) -> float:
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            [message] = claim(queue, 1, worker="queuebench")
            message.ack()
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    def phase_claim_latency(self) -> list[Result]:
        queue = PREFIX + "claim"
        self.fill(queue, 600)
        empty = self._claim_ack_ms(queue)
        self.say(f"claim_latency: loading {self.config.archive_rows} archive rows, {self.config.scheduled} scheduled")
        self.fill_archive(self.config.archive_rows)
        enqueue_many(queue, [self.payload] * self.config.scheduled, delay=86_400, using=self.using)
        loaded = self._claim_ack_ms(queue)
        extra = {"empty_ms": empty, "archive_rows": self.config.archive_rows, "scheduled": self.config.scheduled}
        return [Result("claim+ack median, loaded tables", loaded, "ms", empty, extra)]

    def phase_memory(self) -> list[Result]:
        """One worker process over many messages: RSS once warm, and at the end."""
        queue = PREFIX + "memory"
        count = self.config.memory_messages
        self.fill(queue, count)
        with tempfile.TemporaryDirectory(prefix="queuebench-") as reports:
            path = os.path.join(reports, "memory.json")
            worker = spawn("memory-worker", queue, self.config, "--report", path)
            if worker.wait(timeout=3600) != 0:
                raise RuntimeError(f"memory: the worker exited with {worker.returncode}")
            with open(path) as report:
                curve = json.load(report)["rss_by_tenth_mb"]
        if len(curve) < 10:
            raise RuntimeError(f"memory: {len(curve)} of 10 memory readings (the worker reads /proc: Linux only)")
        # The first reading is after a tenth of the messages: the worker is warm by then.
        extra = {
            "messages": count,
            "rss_warm_mb": curve[0],
            "rss_end_mb": curve[-1],
            "rss_max_mb": max(curve),
            "rss_by_tenth_mb": [round(r, 1) for r in curve],
        }
        return [Result(f"worker RSS growth over {count} messages", curve[-1] - curve[0], "MB", None, extra)]

    def _page_ms(self, paginator_class: type[Paginator[Any]], queryset: Any, rounds: int = 15) -> float:
        """The median time to count a list and read its first page of 100, as the admin does."""
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            paginator = paginator_class(queryset, 100)
            paginator.count  # noqa: B018 (the count is what is measured)
            list(paginator.page(1).object_list)
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times)

    def phase_admin_list(self) -> list[Result]:
        """The archive's admin list with ``archive_rows`` rows: our paginator against Django's COUNT(*)."""
        from ...paginator import EstimatingPaginator

        rows = self.config.archive_rows
        self.say(f"admin_list: loading {rows} archive rows")
        self.fill_archive(rows)
        refresh_statistics(self.using, ArchivedMessage._meta.db_table, force=True)
        archive = ArchivedMessage.objects.using(self.using).all()
        one_queue = archive.filter(queue=PREFIX + "claim-history")
        extra = {"archive_rows": rows, "count_cap": EstimatingPaginator.count_cap}
        return [
            Result(
                "admin archive page, whole table",
                self._page_ms(EstimatingPaginator, archive),
                "ms",
                self._page_ms(Paginator, archive),
                extra,
            ),
            Result(
                "admin archive page, filtered by queue",
                self._page_ms(EstimatingPaginator, one_queue),
                "ms",
                self._page_ms(Paginator, one_queue),
                extra,
            ),
        ]

    def phase_archive(self) -> list[Result]:
        """Retention of half of --history-days: dropping partitions against the reaper's batched DELETE."""
        from ...db.partitions import supported
        from .retention import RetentionBench

        if not supported(self.using):
            self.say("archive: skipped, SQLite has no partitions")
            return []
        workers, batch = self.config.workers, self.config.batch_size

        def drain() -> float:
            return self._drain("orm-worker", workers=workers, batch_size=batch, messages=self.config.messages)[0]

        rows, days = self.config.history_rows, self.config.history_days
        self.say(f"archive: {rows:,} archived rows over {days} days, each layout in turn")
        acks = ArchivedMessage.objects.using(self.using).filter(queue=PREFIX + "drain")

        def draining(since: datetime) -> bool:
            return acks.filter(finished_at__gte=since).exists()

        bench = RetentionBench(self.using, rows, days, get_settings().reap_batch_size, drain, self.fill, draining)
        measured = bench.run()
        delete, drop = measured["delete"], measured["drop"]
        sizes = f"{rows:,} rows, {days} days, keep {days - days // 2}"
        return [
            Result(
                f"archive retention: drop vs DELETE ({sizes})",
                drop["retention_seconds"],
                "s",
                delete["retention_seconds"],
                {"delete": delete, "drop": drop},
            ),
            Result(
                "drain during retention: partitions dropped", drop["drain_during"], "messages/s", drop["drain_quiet"]
            ),
            Result("drain during retention: rows deleted", delete["drain_during"], "messages/s", delete["drain_quiet"]),
        ]

    def phase_admin_workflows(self) -> list[Result]:
        """The workflows' admin with ``messages`` workflows: the list, filtered, searched; a large workflow's page."""
        from .adminpages import measure

        count = self.config.messages
        self.say(f"admin_workflows: {count:,} workflows and one of {CHAIN_STEPS:,} steps")
        measured = measure(self.using, PREFIX, WORKFLOW_QUEUE, count, CHAIN_STEPS)
        return [Result(name, ours, "ms", baseline, extra) for name, ours, baseline, extra in measured]

    def phase_soak(self) -> list[Result]:
        """Enqueue and drain ``--soak-messages`` with ``--workers`` workers at once: is the end as fast as the start?

        This process produces in chunks, keeping the backlog under a cap so
        the queue stays live rather than becoming a bulk drain. After each
        chunk a probe times one claim statement on a side queue of the same
        table (what index bloat or purge lag slows down). Throughput per
        tenth comes from the archive's finish times. A reaper loop runs
        beside, as in a deployment. Sizes of the live table and its indexes:
        before, after the drain, after one more reaper pass.
        """
        total = self.config.soak_messages
        queue, probe = PREFIX + "soak", PREFIX + "soak-probe"
        table = Message._meta.db_table
        chunk = max(1, min(1000, total // 50))
        cap = max(chunk * 4, self.config.workers * self.config.batch_size * 4)
        live = Message.objects.using(self.using).filter(queue=queue)
        archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
        sizes = {"before": table_size(self.using, table)}
        runtime = str(24 * 3600)
        workers = [
            spawn("orm-worker", queue, self.config, "--forever", "--max-runtime", runtime)
            for _ in range(self.config.workers)
        ]
        probes: list[list[float]] = [[] for _ in range(10)]
        enqueued = 0
        # A reaper runs beside, as in a deployment (reapqueue --loop, or runqueueworker --reap).
        reaping = threading.Event()
        reaper = threading.Thread(target=Reaper(self.using).loop, args=(reaping,), name="queuebench-reaper")
        reaper.start()
        try:
            while enqueued < total:
                if live.count() >= cap:
                    time.sleep(0.005)
                    continue
                take = min(chunk, total - enqueued)
                enqueue_many(queue, [self.payload] * take, using=self.using)
                enqueued += take
                enqueue(probe, self.payload, using=self.using)
                started = time.perf_counter()
                claimed = claim(probe, 1, worker="queuebench-probe")
                probes[min(9, (enqueued - 1) * 10 // total)].append((time.perf_counter() - started) * 1000)
                ack_many(claimed)
                if any(worker.poll() is not None for worker in workers):
                    raise RuntimeError("soak: a worker exited early")
            deadline = time.monotonic() + 600
            while live.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            reaping.set()
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=120)
            reaper.join(timeout=600)
        done = archive.count()
        distinct = archive.values("message_id").distinct().count()
        if done != total or distinct != total or live.exists():
            raise RuntimeError(f"soak: {done} archive rows ({distinct} distinct) for {total} messages")
        sizes["after_drain"] = table_size(self.using, table)
        Reaper(self.using).run_once()
        sizes["after_reaper"] = table_size(self.using, table)
        finished = list(archive.order_by("finished_at").values_list("finished_at", flat=True))
        first_claim = archive.aggregate(first=Min("claimed_at"))["first"]
        starts = [first_claim] + [finished[k * total // 10 - 1] for k in range(1, 10)]
        rates = []
        for k in range(10):
            end = finished[(k + 1) * total // 10 - 1]
            count = (k + 1) * total // 10 - k * total // 10
            rates.append(count / max((end - starts[k]).total_seconds(), 1e-6))
        claim_ms = [statistics.median(p) if p else None for p in probes]
        extra = {
            "messages": total,
            "drained": done,
            "drained_distinct": distinct,
            "workers": self.config.workers,
            "batch_size": self.config.batch_size,
            "backlog_cap": cap,
            "rate_per_tenth": rates,
            "first_tenth_rate": rates[0],
            "last_tenth_rate": rates[-1],
            "last_to_first": rates[-1] / rates[0] if rates[0] else 0.0,
            "claim_ms_per_tenth": claim_ms,
            "sizes": sizes,
        }
        overall = total / max((finished[-1] - first_claim).total_seconds(), 1e-6)
        return [Result(f"soak ({total} messages)", overall, "messages/s", None, extra)]

    def phase_idle(self) -> list[Result]:
        """One worker as ``runqueueworker`` starts it, on an empty queue: its CPU as a percentage of one core."""
        queue = PREFIX + "idle"
        seconds = str(self.config.idle_seconds)
        with tempfile.TemporaryDirectory(prefix="queuebench-") as reports:
            path = os.path.join(reports, "idle.json")
            arguments = ("--forever", "--max-runtime", seconds, "--report", path)
            worker = spawn("default-worker", queue, self.config, *arguments)
            if worker.wait(timeout=self.config.idle_seconds + 120) != 0:
                raise RuntimeError(f"idle: the worker exited with {worker.returncode}")
            with open(path) as report:
                usage = json.load(report)
        percent = usage["cpu_seconds"] / max(usage["wall_seconds"], 1e-6) * 100
        extra = {"cpu_seconds": usage["cpu_seconds"], "wall_seconds": usage["wall_seconds"]}
        return [Result("idle worker CPU", percent, "% of a core", None, extra)]

    def phase_cpu_bound(self) -> list[Result]:
        """A CPU-bound handler (``CPU_MS`` of pure Python per message): ``runqueueworker --concurrency 4``, one
        process, against ``runqueueworker --processes 2``, each draining the same messages with ``--until-empty``.

        Threads share one interpreter lock; processes do not. The rates come
        from the archive's timestamps (first claim to last finish), so the
        processes' start counts for neither side.
        """
        if database_for(CPU_QUEUE) != self.using:
            self.say(f"cpu_bound: skipped; its workers serve {CPU_QUEUE} on the queues' own database, not {self.using}")
            return []
        messages = self.config.cpu_messages
        rounds = rounds_for(CPU_MS)
        threads = self._cpu_drain(messages, rounds, "--concurrency", str(CPU_THREADS))
        pool = self._cpu_drain(messages, rounds, "--processes", str(CPU_PROCESSES))
        extra = {
            "messages": messages,
            "handler_ms": CPU_MS,
            "rounds": rounds,
            "threads": CPU_THREADS,
            "processes": CPU_PROCESSES,
            "cpus": cpu_count(),
            "pool_rate": pool,
            "threads_rate": threads,
            "baseline": CPU_BASELINE,
        }
        return [Result(f"cpu_bound (--processes {CPU_PROCESSES})", pool, "messages/s", threads, extra)]

    def phase_workflows(self) -> list[Result]:
        """Workflow steps against plain messages of the same count, drained by the same workers.

        A chain of ``min(CHAIN_STEPS, messages)`` steps (one worker, batch 1:
        a chain has one step ready at a time) against as many plain messages;
        a fan-out/fan-in (a root, ``messages`` steps after it, one join after
        them all; W workers, batch B) against ``messages + 2`` plain ones; and
        the join's wait, from its last parent's ack to its claim: once in the
        fan-out, and its percentiles over ``min(JOIN_SAMPLES, messages)``
        fan-ins of two parents run one after the other by idle workers. The
        fan-out's time is also split: the root's (its ack enqueues the
        parents), and the parents' own rate against the plain messages'.
        """
        workers, batch, count = self.config.workers, self.config.batch_size, self.config.messages
        chain_steps = min(CHAIN_STEPS, count)
        chain = Workflow(PREFIX + "chain")
        chain.chain(*(Step(f"s{n}", WORKFLOW_QUEUE, self.payload) for n in range(chain_steps)))
        chain_rate, _ = self._workflow_drain(chain, chain_steps, workers=1, batch_size=1)
        plain_chain, _ = self._workflow_drain(None, chain_steps, workers=1, batch_size=1)
        fan = Workflow(PREFIX + "fan")
        fan.add("root", WORKFLOW_QUEUE, self.payload)
        parents = fan.group(*(Step(f"s{n}", WORKFLOW_QUEUE, self.payload) for n in range(count)), after=["root"])
        fan.add("join", WORKFLOW_QUEUE, self.payload, after=parents)
        fan_rate, fan_times = self._workflow_drain(fan, count + 2, workers=workers, batch_size=batch)
        plain_fan, _ = self._workflow_drain(None, count + 2, workers=workers, batch_size=batch)
        samples = min(JOIN_SAMPLES, count)
        waits = self._join_waits(samples, workers=workers, batch_size=batch)
        joins = {
            "p50_ms": percentile(waits, 50),
            "p95_ms": percentile(waits, 95),
            "p99_ms": percentile(waits, 99),
            "joins": samples,
            "nudges": self.config.nudges,
        }
        return [
            Result(
                f"workflow chain ({chain_steps:,} steps, 1 worker, batch 1)",
                chain_rate,
                "steps/s",
                plain_chain,
                {"steps": chain_steps, "baseline": "as many plain messages, the same worker"},
            ),
            Result(
                f"workflow fan-out/fan-in ({count:,} steps, {workers} workers, batch {batch})",
                fan_rate,
                "steps/s",
                plain_fan,
                {
                    "steps": count + 2,
                    **fan_times,
                    **({"parents_ratio": fan_times["parents_rate"] / plain_fan} if "parents_rate" in fan_times else {}),
                    "baseline": "as many plain messages, the same workers",
                },
            ),
            Result(f"workflow join wait p99 ({samples} joins, {workers} workers)", joins["p99_ms"], "ms", None, joins),
        ]

    def _join_waits(self, samples: int, *, workers: int, batch_size: int) -> list[float]:
        """The join's wait in ms (its claim after its last parent's ack) of ``samples`` fan-ins of two parents,
        each enqueued once the previous one finished: what a join waits for idle workers, nudges included."""
        self._clean_workflows()
        self.clean()
        archive = ArchivedMessage.objects.using(self.using).filter(queue=WORKFLOW_QUEUE)
        with self._workflow_workers(workers, batch_size) as drained:
            time.sleep(3)  # let them start and settle into polling
            for n in range(samples):
                fan = Workflow(PREFIX + "join")
                fan.group(Step("a", WORKFLOW_QUEUE, self.payload), Step("b", WORKFLOW_QUEUE, self.payload))
                fan.add("join", WORKFLOW_QUEUE, self.payload, after=["a", "b"])
                fan.enqueue(using=self.using)
                drained(3 * (n + 1), 60, 0.01)
        steps: dict[int, dict[str, Any]] = defaultdict(dict)
        for headers, claimed_at, finished_at in archive.values_list("headers", "claimed_at", "finished_at"):
            workflow_id, name = headers["dbqueue_step"]
            steps[workflow_id][name] = claimed_at if name == "join" else finished_at
        self._clean_workflows()
        return [(s["join"] - max(s["a"], s["b"])).total_seconds() * 1000 for s in steps.values()]

    def _workflow_drain(
        self, workflow: Workflow | None, steps: int, *, workers: int, batch_size: int
    ) -> tuple[float, dict[str, float]]:
        """Drain ``workflow`` (or ``steps`` plain messages) with orm-worker children: steps/s from the archive's
        times (first claim to last finish), and for a fan-out/fan-in (a root, parents, a join), in ms, the join's
        wait (its claim after its parents' last finish) and the root's (its claim to its children's first claim:
        its ack, which enqueues them), and the parents' own steps/s (their first claim to their last finish)."""
        self._clean_workflows()
        self.clean()
        if workflow is None:
            self.fill(WORKFLOW_QUEUE, steps)
        else:
            workflow.enqueue(using=self.using)
        archive = ArchivedMessage.objects.using(self.using).filter(queue=WORKFLOW_QUEUE)
        with self._workflow_workers(workers, batch_size) as drained:
            drained(steps, 3600, 0.2)
        span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
        rate = steps / max((span["last"] - span["first"]).total_seconds(), 1e-6)
        fan: dict[str, float] = {}
        if workflow is not None and steps > 2:
            rows = {row.headers["dbqueue_step"][1]: row for row in archive.filter(headers__has_key="dbqueue_step")}
            root, join = rows.pop("root", None), rows.pop("join", None)
            claims = [row.claimed_at for row in rows.values() if row.claimed_at is not None]
            if root and root.claimed_at and join and join.claimed_at and claims:
                first, last = min(claims), max(row.finished_at for row in rows.values())
                fan["join_wait_ms"] = (join.claimed_at - last).total_seconds() * 1000
                fan["root_ms"] = (first - root.claimed_at).total_seconds() * 1000
                fan["parents_rate"] = len(rows) / max((last - first).total_seconds(), 1e-6)
        self._clean_workflows()
        return rate, fan

    @contextlib.contextmanager
    def _workflow_workers(self, workers: int, batch_size: int) -> Iterator[Callable[[int, float, float], None]]:
        """orm-worker children on the workflows' queue, given SIGTERM at the end; yields ``drained(count,
        seconds, poll)``, which returns once ``count`` rows are archived (raises past ``seconds`` or when a
        child died). They run until then: a worker idle while a step's ack enqueues the next must not leave."""
        children = [
            spawn("orm-worker", WORKFLOW_QUEUE, self.config, "--forever", batch_size=batch_size) for _ in range(workers)
        ]
        archive = ArchivedMessage.objects.using(self.using).filter(queue=WORKFLOW_QUEUE)

        def drained(count: int, seconds: float, poll: float) -> None:
            deadline = time.monotonic() + seconds
            while archive.count() < count:
                if time.monotonic() > deadline or any(child.poll() is not None for child in children):
                    raise RuntimeError(f"workflows: {archive.count()} of {count} steps drained")
                time.sleep(poll)

        try:
            yield drained
        finally:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                child.wait(timeout=120)

    def _clean_workflows(self) -> None:
        runs = WorkflowRun.objects.using(self.using).filter(name__startswith=PREFIX)
        ids = list(runs.values_list("pk", flat=True))
        WorkflowEdge.objects.using(self.using).filter(workflow_id__in=ids)._raw_delete(self.using)
        WorkflowStep.objects.using(self.using).filter(workflow_id__in=ids)._raw_delete(self.using)
        runs._raw_delete(self.using)

    def _cpu_drain(self, messages: int, rounds: int, *options: str) -> float:
        """``runqueueworker queuebench.cpu --until-empty OPTIONS`` drains ``messages``: messages/s."""
        self.clean()
        enqueue_many(CPU_QUEUE, [{"rounds": rounds}] * messages, using=self.using)
        command = [sys.executable, "-m", "django", "runqueueworker", CPU_QUEUE, "--until-empty", "--no-schedules"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), CPU_HANDLER_ENVIRONMENT: "1"}
        worker = subprocess.Popen([*command, "-v", "0", *options], env=env)
        if worker.wait(timeout=3600) != 0:
            raise RuntimeError(f"cpu_bound: runqueueworker {' '.join(options)} exited with {worker.returncode}")
        archive = ArchivedMessage.objects.using(self.using).filter(queue=CPU_QUEUE)
        if archive.count() != messages:
            raise RuntimeError(f"cpu_bound: {archive.count()} of {messages} messages drained")
        span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
        seconds: float = (span["last"] - span["first"]).total_seconds()
        return messages / max(seconds, 1e-6)

    def phase_async_io(self) -> list[Result]:
        """I/O-bound handlers (``IO_MS`` of waiting per message): one process whose ``async def`` handler
        awaits, ``--async-concurrency IO_ASYNC``, against the same wait slept by a sync handler in one
        process of ``IO_THREADS`` threads, and in a pool of ``IO_PROCESSES`` such processes.

        Rates as in ``cpu_bound`` (first claim to last finish, from the
        archive); memory is the peak resident memory of the worker's process
        tree (a pool: supervisor and children), sampled while it drains.
        """
        queues = {database_for(IO_ASYNC_QUEUE), database_for(IO_SYNC_QUEUE)}
        if queues != {self.using}:
            self.say(f"async_io: skipped; its workers serve its queues on their own database, not {self.using}")
            return []
        messages, seconds = self.config.io_messages, IO_MS / 1000
        runs = {
            "async": self._io_drain(IO_ASYNC_QUEUE, messages, seconds, "--async-concurrency", str(IO_ASYNC)),
            "threads": self._io_drain(IO_SYNC_QUEUE, messages, seconds, "--concurrency", str(IO_THREADS)),
            "pool": self._io_drain(
                IO_SYNC_QUEUE, messages, seconds, "--processes", str(IO_PROCESSES), "--concurrency", str(IO_THREADS)
            ),
        }
        extra: dict[str, Any] = {
            "messages": messages,
            "handler_ms": IO_MS,
            "async_concurrency": IO_ASYNC,
            "threads": IO_THREADS,
            "processes": IO_PROCESSES,
            "baseline": IO_BASELINE,
        }
        for name, (rate, rss) in runs.items():
            extra[f"{name}_rate"], extra[f"{name}_rss_mb"] = rate, rss
        extra["pool_ratio"] = runs["async"][0] / runs["pool"][0] if runs["pool"][0] else 0.0
        ours, baseline = runs["async"][0], runs["threads"][0]
        return [Result(f"async_io (--async-concurrency {IO_ASYNC})", ours, "messages/s", baseline, extra)]

    def _io_drain(self, queue: str, messages: int, seconds: float, *options: str) -> tuple[float, float]:
        """``runqueueworker QUEUE --until-empty OPTIONS`` drains ``messages``: messages/s and peak RSS in MB."""
        self.clean()
        enqueue_many(queue, [{"seconds": seconds}] * messages, using=self.using)
        command = [sys.executable, "-m", "django", "runqueueworker", queue, "--until-empty", "--no-schedules"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), IO_HANDLER_ENVIRONMENT: "1"}
        worker = subprocess.Popen([*command, "-v", "0", *options], env=env)
        peak = 0.0
        while worker.poll() is None:
            peak = max(peak, tree_rss_mb(worker.pid))
            time.sleep(0.05)
        if worker.returncode != 0:
            raise RuntimeError(f"async_io: runqueueworker {' '.join(options)} exited with {worker.returncode}")
        archive = ArchivedMessage.objects.using(self.using).filter(queue=queue)
        if archive.count() != messages or archive.values("message_id").distinct().count() != messages:
            raise RuntimeError(f"async_io: {archive.count()} of {messages} messages drained")
        span = archive.aggregate(first=Min("claimed_at"), last=Max("finished_at"))
        elapsed: float = (span["last"] - span["first"]).total_seconds()
        return messages / max(elapsed, 1e-6), peak

    # --- data ------------------------------------------------------------------

    def fill(self, queue: str, count: int, groups: int = 0) -> None:
        """``count`` messages; with ``groups``, the n-th in group n modulo ``groups`` (customers' work interleaved)."""
        for start in range(0, count, 10_000):
            size = min(10_000, count - start)
            if not groups:
                enqueue_many(queue, [self.payload] * size, using=self.using)
                continue
            pending = [
                build_message(queue, self.payload, {"group": f"g{n % groups}"}) for n in range(start, start + size)
            ]
            Message.objects.using(self.using).insert_built(pending)
        # What the reaper or autovacuum would do after a bulk load (PostgreSQL only).
        refresh_statistics(self.using, Message._meta.db_table, force=True)

    def fill_archive(self, rows: int) -> None:
        """Archived rows for the claim-latency and admin-list phases: real acks, then INSERT ... SELECT doubling."""
        seed_queue = PREFIX + "claim-history"
        have = min(rows, 1000)
        self.fill(seed_queue, have)
        ack_many(claim(seed_queue, have, worker="queuebench"))
        columns = (
            "message_id, queue, kind, payload, headers, priority, created_at, first_available_at, claimed_at, "
            "finished_at, attempts, outcome, finished_by, last_error, replayed_by"
        )
        with connections[self.using].cursor() as cursor:
            while have < rows:
                take = min(have, rows - have)
                cursor.execute(
                    f"INSERT INTO dbqueue_archive ({columns}) SELECT {columns} FROM dbqueue_archive "
                    f"WHERE queue = %s LIMIT {int(take)}",
                    [seed_queue],
                )
                have += take


def as_table(results: list[Result], config: BenchConfig) -> str:
    lines = [
        f"queuebench on {vendor(config.database)} ({config.database}): {config.messages} messages, "
        f"{config.workers} workers, batch {config.batch_size}, payload {config.payload_bytes} B"
        + (f"; medians of {config.repeat} runs" if config.repeat > 1 else ""),
        "",
        f"{'phase':<44} {'ours':>14} {'raw SQL':>14} {'ours/raw':>9}",
    ]
    for r in results:
        baseline = f"{r.baseline:,.1f}" if r.baseline is not None else "-"
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
        lines.append(f"{r.phase:<44} {r.ours:>10,.1f} {r.unit:<3} {baseline:>14} {ratio:>9}")
        if r.phase.startswith(("end-to-end", "workflow join")):
            lines.append(
                f"{'':<4}p50 {r.extra['p50_ms']:.1f} ms, p95 {r.extra['p95_ms']:.1f} ms, p99 {r.extra['p99_ms']:.1f} ms"
            )
        if "parents_ratio" in r.extra:
            lines.append(
                f"{'':<4}the parents alone {r.extra['parents_rate']:,.1f} steps/s ({r.extra['parents_ratio']:.2f} of "
                f"plain); the root's ack {r.extra['root_ms']:,.0f} ms; the join's wait {r.extra['join_wait_ms']:.1f} ms"
            )
        if "cpu_ms_per_message" in r.extra:
            lines.append(
                f"{'':<4}{r.extra['ms_per_message']:.2f} ms per message (raw {r.extra['raw_ms_per_message']:.2f}); "
                f"worker CPU {r.extra['cpu_ms_per_message']:.3f} ms per message "
                f"(raw {r.extra['raw_cpu_ms_per_message']:.3f}, {r.extra['cpu_ratio']:.2f}x)"
            )
        if "cpu_us_per_message" in r.extra:
            lines.append(
                f"{'':<4}producer CPU {r.extra['cpu_us_per_message']:.1f} µs per message "
                f"(raw {r.extra['raw_cpu_us_per_message']:.1f}, {r.extra['cpu_ratio']:.2f}x)"
            )
        if r.phase.startswith("claim+ack"):
            lines.append(f"{'':<4}baseline here is the same claim+ack on empty tables, not raw SQL")
        if r.phase.startswith("drain_groups"):
            lines.append(
                f"{'':<4}baseline here is our drain of the same messages in no group, not raw SQL; worker CPU "
                f"{r.extra['grouped_cpu_ms_per_message']:.3f} ms per message "
                f"(in no group {r.extra['ungrouped_cpu_ms_per_message']:.3f})"
            )
        if r.phase.startswith("cpu_bound"):
            lines.append(
                f"{'':<4}baseline here is {CPU_BASELINE}, not raw SQL; a handler of "
                f"{CPU_MS:g} ms of pure Python, {r.extra['cpus']:g} CPUs"
            )
        if r.phase.startswith("archive retention"):
            # Each run's figures (with --repeat, the medians keep only the numbers).
            for side, m in ((side, run[side]) for run in r.extra.get("runs", [r.extra]) for side in ("delete", "drop")):
                garbage = ", ".join(
                    f"{key.removesuffix('_after')} {m[key]:,} after (before {m[key.replace('_after', '_before')]:,})"
                    for key in m
                    if key.endswith("_after") and key != "bytes_after" and m[key] is not None
                )
                lines.append(
                    f"{'':<4}{side}: pass {m['retention_seconds']:.3f} s, "
                    f"{m['rows_removed']:,} of {m['rows']:,} rows gone, {m['rows_deleted']:,} deleted "
                    f"row by row, {m['partitions_dropped']} partitions retired; {garbage}; "
                    f"{m['bytes_before'] / 2**20:,.0f} MB before, {m['bytes_after'] / 2**20:,.0f} MB after"
                    + (
                        f"; their {m['tables_freed']} tables freed afterwards in {m['free_seconds']:.2f} s"
                        if m["tables_freed"]
                        else ""
                    )
                    + ("" if m["amid_acks"] else "; started before the drain acked, which it waited for in vain")
                )
        if r.phase.startswith("drain during retention"):
            lines.append(f"{'':<4}baseline here is the same drain just before the retention pass, not raw SQL")
        if r.phase.startswith("admin archive page"):
            rows = r.extra["archive_rows"]
            lines.append(f"{'':<4}baseline here is Django's paginator (COUNT(*)), over {rows:,} archived rows")
        if r.phase.startswith("worker RSS"):
            lines.append(
                f"{'':<4}RSS {r.extra['rss_warm_mb']:.1f} MB once warm, {r.extra['rss_end_mb']:.1f} MB at the end"
            )
        if r.phase.startswith("soak"):
            x = r.extra
            lines.append(
                f"{'':<4}first tenth {x['first_tenth_rate']:,.0f}/s, last tenth {x['last_tenth_rate']:,.0f}/s "
                f"(last/first {x['last_to_first']:.2f}); {x['drained_distinct']:,} drained, each once"
            )
            lines.append(f"{'':<4}per tenth, msg/s: {', '.join(f'{v:,.0f}' for v in x['rate_per_tenth'])}")
            claims = ", ".join("-" if v is None else f"{v:.2f}" for v in x["claim_ms_per_tenth"])
            lines.append(f"{'':<4}probe claim median per tenth, ms: {claims}")
            for when, size in x["sizes"].items():
                lines.append(f"{'':<4}live table {when}: {size}")
        if r.phase.startswith("idle"):
            lines.append(f"{'':<4}{r.extra['cpu_seconds']:.3f} s CPU over {r.extra['wall_seconds']:.1f} s")
    return "\n".join(lines)


def as_json(results: list[Result], config: BenchConfig) -> dict[str, Any]:
    return {
        "config": {**asdict(config), "vendor": vendor(config.database)},
        "results": [{**asdict(r), "ratio": r.ratio} for r in results],
    }
