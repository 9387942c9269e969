"""The pool's supervisor: ``runqueueworker --processes N`` (docs/workers.md, "A pool of processes").

A `Supervisor` starts N child processes, each today's one-process worker
(`QueueWorker`, ``--concurrency`` threads) with its own Worker row that
names the supervisor's row, and keeps them running: a child that dies is
restarted with a bounded backoff, a child that cannot start stops the pool
(`START_FAILURES` in a row: an import error after a deploy, say) instead
of a restart storm; SIGHUP replaces every child one after another, each
replacement ready before its predecessor is told to stop; SIGTTIN and
SIGTTOU add and remove one; a child recycled (``--max-messages-per-child``,
``--max-memory-per-child``) says so as it starts to leave, and its
replacement starts at once.

The supervisor runs no handler and holds no transaction. Its main thread
is an event loop (signals arrive through a wake-up socket, children talk
through their `tether`); the database work (its own row, the dead
children's rows, the autoscaler's reading) is done by one monitor thread,
so that a slow database never delays a signal or a restart. A thread that
crashes stops the pool with status 1 (`Lifecycle.thread`).

Children are started with ``subprocess`` as ``python -m django
runqueueworker ...``, not forked: forking a process whose database
connections and threads exist is unsafe, and ``multiprocessing``'s "spawn"
would re-import the supervisor's ``__main__`` and pickle the child's
configuration, where a command line gives each child exactly the worker
users run alone (its own argv in ``ps``, its own console, signals and exit
status). The child gets the supervisor's environment, with its
``sys.path`` (the project's directories) in ``PYTHONPATH``, and runs in a
process group of its own, so a terminal's CONTROL-C reaches the supervisor
only.

Queues on several databases (their ``DATABASE`` option) are served by one
pool: each child serves the queues of one database (child ``slot`` those of
database ``slot mod k``, in the order the queues were named), so that a
database that fails stalls only its own children, and the first child of
each database runs its reaper and schedules. The supervisor's row is kept
in every one of them, each beat on its own.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import secrets
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from .. import handlers as handler_registry
from .._version import __version__
from ..conf import describe_placement, get_settings, queues_by_database
from ..console import event
from ..db.errors import DATABASE_TROUBLE
from ..exceptions import InvalidOption
from ..models import Message, QueueState
from ..models import Worker as WorkerRow
from ..validation import validate_queues
from .autoscale import Autoscaler, Reading
from .config import ExitStatus, WorkerConfig
from .lifecycle import Ending, Lifecycle
from .process import split_queues
from .tether import NOW, STOP

logger = logging.getLogger("django_dbqueue")

START_FAILURES = 3  # children in a row that exit before they are ready: the pool stops
START_TIMEOUT = 120.0  # seconds a child may take to say it is ready before it is killed (a failed start)
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0  # seconds before restarting a child that died, doubling per death
HEALTHY_AFTER = 60.0  # a child that ran this long before it died starts its slot's backoff afresh
STOP_MARGIN = 15.0  # seconds past the grace a stopping child may take before it is killed
FORCE_WAIT = 5.0  # seconds children get to exit after a second signal before they are killed
TICK = 0.5  # the event loop's longest sleep


@dataclass
class PoolConfig:
    """What ``runqueueworker`` tells a pool beyond what each child is told (a `WorkerConfig`)."""

    processes: int = 2  # children to start with
    min_processes: int | None = None  # --autoscale MIN,MAX: the bounds (docs/workers.md, "Autoscaling")
    max_processes: int | None = None
    max_messages_per_child: int | None = None  # recycling (worker/recycling.py)
    max_memory_per_child: float | None = None  # megabytes
    verbosity: int = 1  # passed to the children, with --json-logs
    json_logs: bool = False

    def __post_init__(self) -> None:
        """Refuse a pool of no process, and bounds the wrong way round (the command's parser does too)."""
        for name in ("processes", "min_processes", "max_processes", "max_messages_per_child"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidOption(f"PoolConfig {name} must be a whole number of at least 1, not {value!r}")
        if (self.min_processes is None) != (self.max_processes is None):
            raise InvalidOption("PoolConfig min_processes and max_processes go together (autoscaling's bounds)")
        low, high = self.min_processes, self.max_processes
        if low is not None and high is not None and not low <= self.processes <= high:
            raise InvalidOption(
                f"PoolConfig processes ({self.processes}) must lie between min_processes ({low}) "
                f"and max_processes ({high})"
            )
        if self.max_memory_per_child is not None and not 0 < self.max_memory_per_child < float("inf"):
            raise InvalidOption(
                f"PoolConfig max_memory_per_child must be megabytes above 0, not {self.max_memory_per_child!r}"
            )


class State(enum.StrEnum):
    STARTING = "starting"  # started, not ready yet
    READY = "ready"  # its row registered, its threads running
    LEAVING = "leaving"  # stopping: asked to, recycled, its work done, or crashed


@dataclass(eq=False)
class Child:
    """One child process and the supervisor's end of its socket."""

    slot: int
    process: subprocess.Popen[bytes]
    link: socket.socket
    generation: int
    started: float = field(default_factory=time.monotonic)
    state: State = State.STARTING
    name: str = ""  # its worker row's name, once it is ready
    ending: str = ""  # why it leaves (an Ending, or "asked")
    ready_at: float | None = None
    replaces: Child | None = None  # the child it replaces (a rolling restart, a recycling), until it is ready
    recycle: str = ""  # why it asked for its replacement (it passed a limit), until it leaves
    pending: bytes = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def serving(self) -> bool:
        """Counted in the pool's size: not leaving (a crashing child counts until it exits, for its backoff)."""
        return self.replaces is None and (self.state != State.LEAVING or self.ending == Ending.CRASH)

    def tell(self, word: str) -> bool:
        """Send ``word`` to the child; False when its socket is gone."""
        try:
            self.link.sendall(f"{word}\n".encode())
        except OSError:
            return False
        return True

    def describe(self) -> str:
        return f"child {self.slot} (pid {self.pid})"


def exit_text(status: int) -> str:
    """``exit status 1``, ``killed by SIGKILL``: how a child ended, for people."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def child_environment() -> dict[str, str]:
    """The supervisor's environment, with the project's ``sys.path`` entries in ``PYTHONPATH``.

    Entries inside the interpreter's own directories (the standard library,
    site-packages) come back by themselves; the project's (the directory of
    manage.py, ``--pythonpath``) would not.
    """
    env = dict(os.environ)
    if "DJANGO_SETTINGS_MODULE" not in env:
        raise InvalidOption(
            "a pool starts its children with DJANGO_SETTINGS_MODULE, which is not set "
            "(manage.py sets it; or give --settings)"
        )
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    own = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if any(path == p or path.startswith(p + os.sep) for p in prefixes) or path in own:
            continue
        own.append(path)
    env["PYTHONPATH"] = os.pathsep.join([*own, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def child_command() -> list[str]:
    """How a child starts: this interpreter running Django's command line (see the module's docstring)."""
    return [sys.executable, "-m", "django", "runqueueworker"]


class Supervisor:
    """Keeps ``pool.processes`` children running ``config`` until told to stop; returns the pool's exit status.

    ``command`` replaces `child_command` (tests start stand-ins).
    """

    def __init__(self, config: WorkerConfig, pool: PoolConfig, *, command: Sequence[str] | None = None) -> None:
        if config.max_messages is not None:
            raise InvalidOption("--max-messages counts one process's messages: give --max-messages-per-child")
        queues = config.queues or sorted({q for q, _ in handler_registry.registered()})
        if not queues:
            raise InvalidOption("no queues to serve: name them, or register handlers in an app's queues.py")
        self.config = config
        self.pool = pool
        self.queues = validate_queues(queues)
        self.groups = queues_by_database(self.queues)
        self.databases = list(self.groups)
        self.using = self.databases[0]
        if len(self.databases) > 1:
            where = describe_placement(self.groups)
            if pool.min_processes is not None:
                raise InvalidOption(
                    f"--autoscale reads one database's backlog, and these queues live on {len(self.databases)} "
                    f"({where}): run one autoscaled pool per database"
                )
            if pool.processes < len(self.databases):
                raise InvalidOption(
                    f"these queues live on {len(self.databases)} databases ({where}) and each child serves one: "
                    f"give --processes {len(self.databases)} or more, not {pool.processes}"
                )
        dbq = get_settings()
        self.grace = dbq.shutdown_grace if config.grace is None else config.grace
        self.heartbeat_interval = dbq.heartbeat_interval
        self.autoscale_interval = dbq.autoscale_interval
        self.autoscaler: Autoscaler | None = None
        if pool.min_processes is not None and pool.max_processes is not None:
            self.autoscaler = Autoscaler(
                pool.min_processes, pool.max_processes, wait=dbq.autoscale_wait, idle=dbq.autoscale_idle
            )
        # What one busy child holds: its threads' claims (adaptive ones: one each, as when busy with slow jobs),
        # and its event loop's slots if a queue is all async.
        self.per_child = config.concurrency * (config.batch_size or 1)
        if split_queues(self.queues, config.handler)[0]:
            self.per_child += config.async_concurrency
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.command = list(command) if command is not None else child_command()
        self.env = child_environment() if command is None else dict(os.environ)
        self.target = pool.processes
        self.lifecycle = Lifecycle(self.name)
        self.children: list[Child] = []
        self.generation = 0  # raised by SIGHUP: every child of an older one is replaced
        self.start_failures = 0  # in a row, pool-wide
        self.slot_deaths: dict[int, int] = {}  # deaths in a row per slot, for its backoff
        self.slot_not_before: dict[int, float] = {}  # when a slot may be started again
        self.winding_down = False  # --until-empty: a child found the queues empty; no new children
        self.counts = {"started": 0, "restarted": 0, "recycled": 0, "grown": 0, "shrunk": 0}
        self.decision = ""  # the last scaling decision, for the row and the log
        self.status = ExitStatus.OK
        self.why = ""  # why the pool stops
        self.forced_at: float | None = None
        self.stop_deadline: float | None = None
        self._signals: list[int] = []
        self._previous_handlers: dict[int, Any] = {}
        self._previous_wakeup = -1
        self._dead_rows: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._readings: queue.SimpleQueue[Reading] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._state: dict[str, Any] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)

    # --- the child's command line --------------------------------------------

    def child_args(self, slot: int, fd: int) -> list[str]:
        """The ``runqueueworker`` arguments of the child in ``slot``, whose end of its socket is ``fd``.

        The child serves the queues of one database (`queues_by_database`); the
        reaper (``--reap``) and the schedules run in the first child of each
        database only: once per pool and database.
        """
        c = self.config
        first = slot < len(self.databases)
        served = self.groups[self.databases[slot % len(self.databases)]]
        args = [*served, "--concurrency", str(c.concurrency), "--async-concurrency", str(c.async_concurrency)]
        if c.batch_size is not None:
            args += ["--batch-size", str(c.batch_size)]
        for option, value in (
            ("--async-timeout", c.async_timeout),
            ("--poll-interval", c.poll_interval),
            ("--max-poll-interval", c.max_poll_interval),
            ("--visibility-timeout", c.visibility_timeout),
            ("--grace", c.grace),
            ("--max-messages-per-child", self.pool.max_messages_per_child),
            ("--max-memory-per-child", self.pool.max_memory_per_child),
        ):
            if value is not None:
                args += [option, repr(value)]
        if c.until_empty:
            args.append("--until-empty")
        argv = getattr(c.handler, "argv", None)  # exec mode
        if argv:
            args += ["--exec", shlex.join(argv)]
            timeout = getattr(c.handler, "timeout", None)
            if timeout is not None:
                args += ["--exec-timeout", repr(timeout)]
        if c.reap and first:
            args.append("--reap")
        if not c.schedules or not first:
            args.append("--no-schedules")
        args += ["-v", str(self.pool.verbosity)]
        if self.pool.json_logs:
            args.append("--json-logs")
        return [*args, "--pool-child-of", self.name, "--pool-fd", str(fd)]

    # --- the run ---------------------------------------------------------------

    def run(self) -> ExitStatus:
        started = time.monotonic()
        self._install_signals()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            self.register()
            monitor = self.lifecycle.thread(self._monitor, "dbqueue-pool-monitor")
            self.log_banner()
            self._publish()
            monitor.start()
            while True:
                self._wait()
                self._take_signals()
                self._reap()
                if self.lifecycle.crashed and self.stop_deadline is None:
                    self.begin_stop("a thread of the supervisor crashed", ExitStatus.ERROR)
                if self.stop_deadline is None:
                    if self.config.max_runtime and time.monotonic() - started >= self.config.max_runtime:
                        self.begin_stop("max runtime reached")
                    elif self.winding_down and not self.children:
                        self.begin_stop("every child found the queues empty")
                    else:
                        self._maintain()
                if self.stop_deadline is not None:
                    if not self.children:
                        break
                    self._hurry()
                self._publish()
            self.lifecycle.finished.set()
            monitor.join(timeout=10)
            self.unregister()
        finally:
            self._close()
            self._restore_signals()
            connections.close_all()
        self.log_summary(time.monotonic() - started)
        return self.status

    def _wait(self) -> None:
        """Sleep until a signal, a word from a child, or the next tick."""
        for key, _ in self._selector.select(TICK):
            if key.data is None:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            else:
                self._read(key.data)

    def wake(self) -> None:
        """Wake the event loop (from another thread)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # --- children --------------------------------------------------------------

    def start_child(self, slot: int, replaces: Child | None = None) -> Child | None:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [*self.command, *self.child_args(slot, theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                process_group=0,
            )
        except OSError as exc:
            ours.close()
            logger.error("pool %s: cannot start a child: %s", self.name, exc)
            self._start_failed(slot, f"cannot start: {exc}")
            return None
        finally:
            theirs.close()
        ours.setblocking(False)
        child = Child(slot, process, ours, self.generation, replaces=replaces)
        self.children.append(child)
        self._selector.register(ours, selectors.EVENT_READ, child)
        self.counts["started"] += 1
        logger.info(
            "pool %s: started child %d (pid %d)%s",
            self.name,
            slot,
            child.pid,
            f" to replace pid {replaces.pid}" if replaces else "",
            extra=event("pool_child_started", pool=self.name, slot=slot, pid=child.pid),
        )
        return child

    def stop_child(self, child: Child, why: str) -> None:
        """Ask ``child`` to stop gracefully; it leaves the pool's count at once."""
        if child.state != State.LEAVING:
            child.state, child.ending = State.LEAVING, "asked"
            logger.info("pool %s: stopping %s: %s", self.name, child.describe(), why)
        child.tell(STOP)

    def _read(self, child: Child) -> None:
        try:
            data = child.link.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # it closed its end: it is exiting; _reap sees the exit
            self._selector.unregister(child.link)
            return
        child.pending += data
        while b"\n" in child.pending:
            line, child.pending = child.pending.split(b"\n", 1)
            word, _, rest = line.decode(errors="replace").strip().partition(" ")
            if word == "ready":
                self._ready(child, rest)
            elif word == "recycle":
                self._recycle(child, rest)
            elif word == "leaving":
                ending, _, why = rest.partition(" ")
                self._leaving(child, ending, why)

    def _ready(self, child: Child, name: str) -> None:
        child.name, child.ready_at = name, time.monotonic()
        if child.state == State.STARTING:
            child.state = State.READY
        self.start_failures = 0
        logger.info("pool %s: %s is ready as worker %s", self.name, child.describe(), name)
        old, child.replaces = child.replaces, None
        if old is not None and old in self.children:
            self.stop_child(old, f"replaced by pid {child.pid}")
        if self.stop_deadline is not None:  # the pool began to stop while it started
            child.tell(STOP)

    def _recycle(self, child: Child, why: str) -> None:
        """``child`` passed one of its limits: its replacement starts now (`_maintain`); it works on until ready."""
        if child.recycle or child.state == State.LEAVING or self.stop_deadline is not None:
            return
        child.recycle = why
        self.counts["recycled"] += 1
        if self.winding_down:  # --until-empty: no new children
            self.stop_child(child, f"recycled ({why}) as the pool winds down")
            return
        logger.info("pool %s: %s is recycled (%s); its replacement starts now", self.name, child.describe(), why)

    def _leaving(self, child: Child, ending: str, why: str) -> None:
        if child.state == State.LEAVING:
            return
        child.state, child.ending = State.LEAVING, ending
        if self.stop_deadline is not None:
            return
        if ending == Ending.RECYCLE:
            logger.info("pool %s: %s stops by itself (%s); it will be replaced", self.name, child.describe(), why)
        elif ending == Ending.DONE:
            if self.config.until_empty:
                self.winding_down = True
            logger.info("pool %s: %s is done (%s)", self.name, child.describe(), why)
        elif ending == Ending.CRASH:
            logger.warning("pool %s: %s is stopping after a crash (%s)", self.name, child.describe(), why)
        else:
            # Told to stop by someone else (an operator, or systemd signalling every process of the unit, when
            # the supervisor's own SIGTERM is on its way): its replacement waits a moment.
            self.slot_not_before[child.slot] = max(self.slot_not_before.get(child.slot, 0.0), time.monotonic() + 1.0)
            logger.info("pool %s: %s is stopping (%s); it will be replaced", self.name, child.describe(), why)

    def _reap(self) -> None:
        for child in list(self.children):
            status = child.process.poll()
            if status is not None:
                self._exited(child, status)

    def _exited(self, child: Child, status: int) -> None:
        self.children.remove(child)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(child.link)
        child.link.close()
        if child.name:
            self._dead_rows.put(child.name)  # its row, if it left one, is stale at once: the reaper takes it
        process_gone(child.pid)
        successor = next((c for c in self.children if c.replaces is child), None)
        if successor is not None:  # a rolling restart's replacement under way takes its slot now
            successor.replaces = None
        how = exit_text(status)
        if self.stop_deadline is not None:
            if status == ExitStatus.ABANDONED and self.status == ExitStatus.OK:
                self.status = ExitStatus.ABANDONED
            logger.info("pool %s: %s exited (%s)", self.name, child.describe(), how)
            return
        if child.state == State.STARTING:  # a rolling restart's replacement too
            self._start_failed(child.slot, how)
        elif child.state == State.LEAVING and child.ending != Ending.CRASH:
            log = logger.info if status in (ExitStatus.OK, ExitStatus.ABANDONED) else logger.warning
            log("pool %s: %s left (%s)", self.name, child.describe(), how)
        elif successor is None:
            self._died(child, how)
        else:
            logger.warning("pool %s: %s died (%s); its replacement is starting", self.name, child.describe(), how)

    def _died(self, child: Child, how: str) -> None:
        """A ready child died: restart its slot after a backoff that doubles while it keeps dying."""
        slot = child.slot
        lived = time.monotonic() - (child.ready_at or child.started)
        deaths = 1 if lived >= HEALTHY_AFTER else self.slot_deaths.get(slot, 0) + 1
        self.slot_deaths[slot] = deaths
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (deaths - 1))
        self.slot_not_before[slot] = time.monotonic() + delay
        self.counts["restarted"] += 1
        logger.warning(
            "pool %s: %s died (%s); restarting it in %gs",
            self.name,
            child.describe(),
            how,
            delay,
            extra=event("pool_child_died", pool=self.name, slot=slot, pid=child.pid, how=how, restart_in=delay),
        )

    def _start_failed(self, slot: int, how: str) -> None:
        """A child that exited before it was ready: start it again after a backoff, or stop the pool."""
        self.start_failures += 1
        if self.start_failures >= START_FAILURES:
            logger.error(
                "pool %s: %d children in a row exited before they were ready (the last: %s); "
                "the pool stops (see the children's errors above)",
                self.name,
                self.start_failures,
                how,
                extra=event("pool_start_failed", pool=self.name, failures=self.start_failures, how=how),
            )
            self.begin_stop("children cannot start", ExitStatus.ERROR)
            return
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self.start_failures - 1))
        self.slot_not_before[slot] = time.monotonic() + delay
        logger.warning(
            "pool %s: child %d exited before it was ready (%s); starting it again in %gs",
            self.name,
            slot,
            how,
            delay,
        )

    # --- keeping the pool's shape --------------------------------------------

    def _maintain(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.state == State.STARTING and now - child.started > START_TIMEOUT:
                logger.warning(
                    "pool %s: %s not ready after %.0fs; killing it", self.name, child.describe(), now - child.started
                )
                self._kill(child)
        if self.winding_down:
            return
        self._autoscale()
        serving = [c for c in self.children if c.serving]
        taken = {c.slot for c in serving}
        missing = [slot for slot in range(self.target) if slot not in taken]
        for slot in missing:
            if now >= self.slot_not_before.get(slot, 0.0):
                self.start_child(slot)
        for child in sorted(serving, key=lambda c: -c.slot):
            if child.slot >= self.target and child.state != State.LEAVING:
                self.stop_child(child, f"the pool shrinks to {self.target}")
        replacing = {c.replaces for c in self.children if c.replaces is not None}
        for child in serving:  # recycled children get their replacements together, not one at a time
            due = now >= self.slot_not_before.get(child.slot, 0.0)  # after a replacement that failed to start
            if child.recycle and child.state == State.READY and child not in replacing and due:
                self.start_child(child.slot, replaces=child)
        self._roll(serving)

    def _autoscale(self) -> None:
        """Act on the monitor's newest reading of the backlog, if any came since the last look."""
        reading = None
        while not self._readings.empty():
            reading = self._readings.get()
        if self.autoscaler is None or reading is None:
            return
        serving = [c for c in self.children if c.serving]
        decision = self.autoscaler.decide(
            reading,
            size=len(serving),
            starting=sum(c.state == State.STARTING for c in serving),
            per_child=self.per_child,
            now=time.monotonic(),
        )
        if decision is None:
            return
        target, why = decision
        self.counts["grown" if target > self.target else "shrunk"] += 1
        self.target, self.decision = target, why
        logger.info(
            "pool %s: %s",
            self.name,
            why,
            extra=event("pool_scaled", pool=self.name, processes=target, reason=why, held=reading.held),
        )

    def _roll(self, serving: list[Child]) -> None:
        """A rolling restart (SIGHUP): one child of an older generation at a time gets its replacement."""
        if any(c.replaces is not None and not c.replaces.recycle for c in self.children):
            return  # one at a time: the last replacement is not ready yet
        old = [c for c in serving if c.generation < self.generation and c.state == State.READY and not c.recycle]
        if old:
            child = min(old, key=lambda c: c.slot)
            if time.monotonic() >= self.slot_not_before.get(child.slot, 0.0):  # after a failed replacement
                self.start_child(child.slot, replaces=child)

    def resize(self, by: int) -> None:
        """SIGTTIN (+1) and SIGTTOU (-1): one child more or less, never fewer than one per database."""
        target = max(len(self.databases), self.target + by)
        if target == self.target:
            logger.info("pool %s: already at one child per database (%d)", self.name, target)
            return
        self.target = target
        if self.pool.max_processes is not None and target > self.pool.max_processes:
            self.pool.max_processes = target
        if self.pool.min_processes is not None and target < self.pool.min_processes:
            self.pool.min_processes = target
        if self.autoscaler is not None and self.pool.min_processes is not None and self.pool.max_processes is not None:
            self.autoscaler.resized(self.pool.min_processes, self.pool.max_processes)
        self.decision = f"{'grew' if by > 0 else 'shrank'} to {target} by {'SIGTTIN' if by > 0 else 'SIGTTOU'}"
        logger.info("pool %s: %s", self.name, self.decision)

    # --- stopping --------------------------------------------------------------

    def begin_stop(self, why: str, status: ExitStatus = ExitStatus.OK) -> None:
        """Stop every child gracefully (they get the grace period); the pool exits when they have."""
        if self.stop_deadline is not None:
            return
        if status != ExitStatus.OK:
            self.status = status
        self.stop_deadline = time.monotonic() + self.grace + STOP_MARGIN
        self.why = why
        logger.info("pool %s stopping: %s", self.name, why)
        for child in self.children:
            child.state, child.ending = State.LEAVING, "asked"
            child.tell(STOP)

    def force_stop(self) -> None:
        """A second signal: every child exits at once (their running messages' leases will expire)."""
        self.forced_at = time.monotonic()
        self.status = ExitStatus.FORCED
        logger.warning("pool %s: second signal, the children exit at once", self.name)
        for child in self.children:
            if child.state == State.STARTING or not child.tell(NOW):
                self._kill(child)

    def _hurry(self) -> None:
        """Kill the children that outlive the stop's deadline, or a second signal's wait."""
        now = time.monotonic()
        late = (self.forced_at is not None and now - self.forced_at > FORCE_WAIT) or (
            self.stop_deadline is not None and now > self.stop_deadline
        )
        if late:
            for child in self.children:
                logger.warning("pool %s: %s did not exit in time; killing it", self.name, child.describe())
                self._kill(child)
            if self.status == ExitStatus.OK:
                self.status = ExitStatus.ABANDONED

    def _kill(self, child: Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()

    def _close(self) -> None:
        """On the way out. After an error in the loop, children are left: closing their sockets tells them
        that their supervisor is gone, and they stop gracefully (`tether`)."""
        self.lifecycle.finished.set()
        for child in self.children:
            child.link.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- signals ---------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # tests run supervisors in threads; signals only reach the main thread

        def on_signal(signum: int, frame: Any) -> None:
            self._signals.append(signum)

        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w.fileno())
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCHLD):
            self._previous_handlers[signum] = signal.signal(signum, on_signal)

    def _restore_signals(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        if self._previous_handlers:
            signal.set_wakeup_fd(self._previous_wakeup)
        self._previous_handlers.clear()

    def _take_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in (signal.SIGTERM, signal.SIGINT):
                if self.stop_deadline is None:
                    self.begin_stop(f"got {signal.Signals(signum).name}")
                elif self.forced_at is None:
                    self.force_stop()
            elif self.stop_deadline is not None:
                continue
            elif signum == signal.SIGHUP:
                self.generation += 1
                logger.info("pool %s: got SIGHUP, replacing every child one after another", self.name)
            elif signum == signal.SIGTTIN:
                self.resize(+1)
            elif signum == signal.SIGTTOU:
                self.resize(-1)

    # --- the supervisor's row, and the monitor thread ---------------------------

    def pool_state(self) -> dict[str, Any]:
        """What the supervisor's row holds: its children and its scaling, for the admin, queuestats and metrics."""
        serving = [c for c in self.children if c.serving]
        return {
            "processes": len(serving),
            "target": self.target,
            "min": self.pool.min_processes,
            "max": self.pool.max_processes,
            "children": [{"slot": c.slot, "pid": c.pid, "state": str(c.state), "name": c.name} for c in self.children],
            **self.counts,
            "decision": self.decision,
        }

    def _publish(self) -> None:
        state = self.pool_state()
        with self._state_lock:
            self._state = state

    def register(self, using: str | None = None) -> None:
        """The supervisor's row, with the queues served there, in ``using`` (None: every database of the pool)."""
        for alias in [using] if using else self.databases:
            WorkerRow.objects.using(alias).register(
                self.name, self.groups[alias], self.config.concurrency, pool=self.pool_state()
            )

    def unregister(self) -> None:
        for alias in self.databases:
            try:
                WorkerRow.objects.using(alias).unregister(self.name)
            except DATABASE_TROUBLE as exc:
                logger.warning("pool %s: could not remove its row on %r (%s); the reaper will", self.name, alias, exc)

    def _monitor(self) -> None:
        """The supervisor's database work: every heartbeat its row, and the rows of children that died;
        with ``--autoscale``, every ``AUTOSCALE_INTERVAL`` a reading of the backlog for the event loop."""
        finished = self.lifecycle.finished
        interval = self.heartbeat_interval
        if self.autoscaler is not None:
            interval = min(interval, self.autoscale_interval)
        last_beat = last_reading = time.monotonic()
        try:
            while not finished.wait(interval):
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_interval - interval / 2:
                    last_beat = now
                    self._beat()
                try:
                    if self.autoscaler is not None and now - last_reading >= self.autoscale_interval - interval / 2:
                        last_reading = now
                        self._readings.put(self.read_backlog())
                        self.wake()
                except DATABASE_TROUBLE as exc:
                    logger.warning("pool %s: a read or write of the database failed (%s)", self.name, exc)
                    connections[self.using].close()
        finally:
            connections.close_all()

    def read_backlog(self) -> Reading:
        """The backlog an autoscaled pool decides on: its unpaused queues' waits, and what its children hold."""
        with self._state_lock:
            names = [c["name"] for c in self._state.get("children", []) if c["name"]]
        messages = Message.objects.using(self.using)
        paused = set(QueueState.objects.using(self.using).paused_names())
        waits = messages.next_waits([queue for queue in self.queues if queue not in paused])
        return Reading(waits=waits, held=messages.held_by(names))

    def _beat(self) -> None:
        """The supervisor's row and its dead children's, in each database on its own: one that fails
        is told in the log and tried again at the next beat, and the others' rows keep beating."""
        dead = []
        while not self._dead_rows.empty():
            dead.append(self._dead_rows.get())
        with self._state_lock:
            state = dict(self._state)
        failed = False
        for alias in self.databases:
            rows = WorkerRow.objects.using(alias)
            try:
                rows.mark_dead(dead)  # a child's row is in its own database; a name found nowhere changes nothing
                if not rows.beat_pool(self.name, state):
                    self.register(alias)  # the reaper took it for dead (a long pause): say it is back
            except DATABASE_TROUBLE as exc:
                failed = True
                logger.warning("pool %s: a read or write of database %r failed (%s)", self.name, alias, exc)
                connections[alias].close()
        if failed:  # marked again next time, where it worked too: marking is idempotent
            for name in dead:
                self._dead_rows.put(name)

    # --- the log ---------------------------------------------------------------

    def log_banner(self) -> None:
        bounds = ""
        if self.pool.min_processes is not None:
            bounds = f" (autoscaled from {self.pool.min_processes} to {self.pool.max_processes})"
        limits = []
        if self.pool.max_messages_per_child:
            limits.append(f"{self.pool.max_messages_per_child} messages")
        if self.pool.max_memory_per_child:
            limits.append(f"{self.pool.max_memory_per_child:g} MB")
        lines = [
            f"django-dbqueue {__version__} pool {self.name}",
            *(f"  queues       {', '.join(names)} (database {alias})" for alias, names in self.groups.items()),
            f"  processes    {self.target}{bounds}, each with concurrency {self.config.concurrency}",
            f"  recycling    {'a child past ' + ' or '.join(limits) if limits else 'off'}",
            "  stop with CONTROL-C or SIGTERM (a second one stops at once); SIGHUP restarts every child;",
            "  SIGTTIN and SIGTTOU add and remove one",
        ]
        logger.info(
            "%s",
            "\n".join(lines),
            extra=event(
                "banner",
                version=__version__,
                pool=self.name,
                queues=self.queues,
                processes=self.target,
                min=self.pool.min_processes,
                max=self.pool.max_processes,
                concurrency=self.config.concurrency,
            ),
        )

    def log_summary(self, elapsed: float) -> None:
        why = f": {self.why}" if self.why else ""
        logger.info(
            "pool %s exits (%s%s): %d children started, %d restarted, %d recycled in %.1fs",
            self.name,
            self.status.name,
            why,
            self.counts["started"],
            self.counts["restarted"],
            self.counts["recycled"],
            elapsed,
            extra=event("summary", pool=self.name, status=self.status.name, reason=self.why, **self.counts),
        )


def process_gone(pid: int) -> None:
    """Tell prometheus_client's multi-process mode that a child is gone: its live gauges go with it."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") or not get_settings().metrics:
        return
    try:
        from prometheus_client import multiprocess
    except ImportError:
        return
    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


__all__ = ["Child", "PoolConfig", "State", "Supervisor", "child_command", "exit_text"]
