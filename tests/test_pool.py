"""A pool of worker processes: ``runqueueworker --processes N`` (django_dbqueue/worker/supervisor.py).

The tests marked ``slow`` start real pools (a supervisor and its children,
each a ``runqueueworker`` process) against the test database. Every pool's
output goes to a file, so that no pipe fills up, and every process a test
started is killed at its end, whatever happened.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import re
import signal
import sys
import time
from collections import Counter
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

import django_dbqueue
from django_dbqueue.exceptions import InvalidOption
from django_dbqueue.models import ArchivedMessage, Message, Outcome, Worker
from django_dbqueue.worker import ExitStatus, QueueWorker, WorkerConfig
from django_dbqueue.worker import supervisor as supervisor_module
from django_dbqueue.worker.supervisor import PoolConfig, Supervisor, child_environment, exit_text
from tests.support.processes import ROOT, LoggedCommands, alive, read_marks, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


# --- helpers -------------------------------------------------------------------


def pool_children(supervisor_pid: int) -> list[int]:
    """The pids of the children a supervisor started (their command lines name it), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--pool-child-of" in argv:
            name = argv[argv.index(b"--pool-child-of") + 1].decode()
            if f":{supervisor_pid}:" in name and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


class Pools(LoggedCommands):
    """`LoggedCommands` for pools: at the end, their children are killed too."""

    what = "pool"

    def close(self) -> None:
        children = [pid for process in self.started for pid in pool_children(process.pid)]
        super().close()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pools(tmp_path):
    pools = Pools(tmp_path)
    yield pools
    pools.close()


def supervisor_row(pid: int) -> Worker | None:
    return Worker.objects.filter(pid=pid, pool__isnull=False).first()


def children_rows(name: str) -> list[Worker]:
    return list(Worker.objects.filter(supervisor=name).order_by("name"))


def wait_for_children(pid: int, count: int, timeout: float = 90) -> tuple[Worker, list[Worker]]:
    """The supervisor's row and its children's, once ``count`` children are registered."""

    def ready():
        row = supervisor_row(pid)
        rows = children_rows(row.name) if row is not None else []
        # The children register themselves; the supervisor writes its own count at its next tick.
        counted = row is not None and (row.pool or {}).get("processes") == count
        return (row, rows) if len(rows) == count and counted else None

    return wait_for(ready, timeout=timeout, what=f"{count} children of pool {pid}")


# --- in this process ---------------------------------------------------------------


def test_recycling_options_need_a_pool():
    with pytest.raises(CommandError, match="recycle a pool's children: give --processes"):
        call_command("runqueueworker", "w-ok", "--max-memory-per-child", "500")
    with pytest.raises(CommandError, match="invalid positive_float value: '0'"):
        call_command("runqueueworker", "w-ok", "--processes", "2", "--max-memory-per-child", "0")


def test_a_child_past_a_limit_asks_for_its_replacement_once(monkeypatch):
    from django_dbqueue.worker import recycling
    from django_dbqueue.worker.ledger import Ledger

    asked = []

    class Line:
        def recycle(self, why):
            asked.append(why)

    ledger = Ledger()
    recycler = recycling.Recycler(Line(), max_messages=2, max_memory=None)
    ledger._count(True, 1)
    recycler.check(ledger)
    assert asked == []
    ledger._count(False, 1)
    recycler.check(ledger)
    recycler.check(ledger)
    assert asked == ["2 messages, at its limit of 2"]
    monkeypatch.setattr(recycling, "resident_megabytes", lambda: 612.4)
    by_memory = recycling.Recycler(Line(), max_messages=None, max_memory=500)
    by_memory.check(ledger)
    assert asked[1] == "resident memory 612 MB, past its limit of 500 MB"


def test_resident_memory_is_this_process_s():
    """50 MB of a fresh anonymous mapping, every page written, show in the figure. (Not a bytes object: malloc
    may serve one from memory the process already holds, freed by earlier tests and never given back, and
    then the figure rightly does not move: seen once in a full run.)"""
    from django_dbqueue.worker.memory import resident_megabytes

    before = resident_megabytes()
    region = mmap.mmap(-1, 50 << 20)
    try:
        for offset in range(0, len(region), mmap.PAGESIZE):
            region[offset] = 1
        assert resident_megabytes() - before > 40
    finally:
        region.close()


def test_pool_options_are_checked_before_anything_starts():
    with pytest.raises(CommandError, match="--max-messages counts one process's messages"):
        call_command("runqueueworker", "w-ok", "--processes", "2", "--max-messages", "5")
    with pytest.raises(CommandError, match="--pool-child-of and --pool-fd go together"):
        call_command("runqueueworker", "w-ok", "--pool-child-of", "x")
    with pytest.raises(CommandError, match="invalid processes value: '0'"):
        call_command("runqueueworker", "w-ok", "--processes", "0")
    with pytest.raises(CommandError, match="queue name"):
        call_command("runqueueworker", "bad queue!", "--processes", "2")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda: WorkerConfig(async_concurrency=0), "async_concurrency must be a whole number of at least 1, not 0"),
        (lambda: WorkerConfig(concurrency=-2), "concurrency must be a whole number of at least 1, not -2"),
        (lambda: WorkerConfig(batch_size=2.5), "batch_size must be a whole number of at least 1, not 2.5"),
        (lambda: WorkerConfig(async_timeout=0), "async_timeout must be a number of seconds above 0, not 0"),
        (lambda: WorkerConfig(max_memory_per_child=float("nan")), "number of megabytes above 0, not nan"),
        (lambda: WorkerConfig(grace=-1), "grace must be a number of seconds of at least 0, not -1"),
        (lambda: PoolConfig(processes=0), "processes must be a whole number of at least 1, not 0"),
        (lambda: PoolConfig(processes=1, min_processes=1), "min_processes and max_processes go together"),
        (lambda: PoolConfig(processes=5, min_processes=1, max_processes=3), r"processes \(5\) must lie between"),
    ],
)
def test_configs_built_in_code_refuse_what_the_command_refuses(make, problem):
    """A config built in code, not parsed by the command: an async_concurrency of 0 would claim nothing, ever."""
    with pytest.raises(django_dbqueue.InvalidOption, match=problem):
        make()


def test_processes_auto_is_one_per_cpu_this_process_may_use():
    from django_dbqueue.management.arguments import processes

    assert processes("auto") == len(os.sched_getaffinity(0))
    assert processes("3") == 3


def test_the_reaper_and_the_schedules_run_in_one_child_only():
    config = WorkerConfig(queues=["w-ok", "w-slow"], concurrency=4, reap=True, grace=5.0)
    pool = Supervisor(config, PoolConfig(processes=3), command=["unused"])
    first, second = pool.child_args(0, 7), pool.child_args(1, 8)
    assert first[:2] == ["w-ok", "w-slow"] and first[first.index("--concurrency") + 1] == "4"
    assert "--reap" in first and "--no-schedules" not in first
    assert "--reap" not in second and "--no-schedules" in second
    assert second[-4:] == ["--pool-child-of", pool.name, "--pool-fd", "8"]
    assert second[second.index("--grace") + 1] == "5.0"
    recycled = Supervisor(config, PoolConfig(max_messages_per_child=100, max_memory_per_child=300.0), command=["x"])
    args = recycled.child_args(1, 8)
    assert args[args.index("--max-messages-per-child") + 1] == "100"
    assert args[args.index("--max-memory-per-child") + 1] == "300.0"


def test_queues_on_two_databases_get_children_of_their_own_each_with_its_reaper_and_schedules():
    config = WorkerConfig(queues=["w-ok", "elsewhere", "w-slow"], reap=True)
    pool = Supervisor(config, PoolConfig(processes=3), command=["unused"])
    assert pool.groups == {"default": ["w-ok", "w-slow"], "queues": ["elsewhere"]}
    args = [pool.child_args(slot, 7) for slot in range(4)]
    assert [a[: a.index("--concurrency")] for a in args] == [["w-ok", "w-slow"], ["elsewhere"]] * 2
    assert ["--reap" in a for a in args] == [True, True, False, False]
    assert ["--no-schedules" in a for a in args] == [False, False, True, True]
    pool.resize(-1)
    pool.resize(-1)
    assert pool.target == 2  # never fewer children than databases
    where = r"2 databases \(default: w-ok, w-slow; queues: elsewhere\)"
    with pytest.raises(InvalidOption, match=where + ".* 2 or more, not 1"):
        Supervisor(config, PoolConfig(processes=1), command=["unused"])
    with pytest.raises(InvalidOption, match="--autoscale reads one database's backlog"):
        Supervisor(config, PoolConfig(processes=2, min_processes=2, max_processes=3), command=["unused"])
    with pytest.raises(InvalidOption, match=where + r" and one worker process serves one: run a pool \(--processes 2"):
        QueueWorker(config)


@pytest.mark.django_db(transaction=True, databases=["default", "faulty"])
def test_a_pool_beats_in_each_database_and_one_that_fails_leaves_the_others_beating(fault_proxy, caplog):
    pool = Supervisor(WorkerConfig(queues=["cut-off", "w-ok"]), PoolConfig(processes=2), command=["unused"])
    assert pool.databases == ["faulty", "default"]  # the failing one is beaten first
    pool.register()
    Worker.objects.register("child-x", ["w-ok"], 1, supervisor=pool.name)
    long_ago = timezone.now() - timedelta(hours=1)
    Worker.objects.filter(name=pool.name).update(last_heartbeat_at=long_ago)
    fault_proxy.cut("dbqueue_worker")  # the faulty database's next statement on the worker table
    pool._dead_rows.put("child-x")
    with caplog.at_level("WARNING", logger="django_dbqueue"):
        pool._beat()
    assert "a read or write of database 'faulty' failed" in caplog.text
    assert Worker.objects.get(name=pool.name).last_heartbeat_at > long_ago  # beaten in "default" all the same
    assert Worker.objects.stale(60).filter(name="child-x").exists()
    assert pool._dead_rows.get_nowait() == "child-x"  # kept, to be marked again where it failed
    fault_proxy.disarm()
    caplog.clear()
    pool._beat()
    assert "failed" not in caplog.text and pool._dead_rows.empty()


def test_exit_statuses_are_told_as_people_say_them():
    assert exit_text(1) == "exit status 1"
    assert exit_text(-signal.SIGKILL) == "killed by SIGKILL"


def test_children_find_the_project_as_the_supervisor_does(monkeypatch):
    env = child_environment()
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE")
    with pytest.raises(django_dbqueue.InvalidOption, match="DJANGO_SETTINGS_MODULE"):
        child_environment()


STAND_IN = """
import os, socket, sys, time
line = socket.socket(fileno=int(sys.argv[sys.argv.index("--pool-fd") + 1]))
mode = os.environ["STAND_IN"]
if mode == "fail":
    sys.exit(1)
line.sendall(f"ready stand-in-{os.getpid()}\\n".encode())
if mode == "die":
    time.sleep(0.2)
    sys.exit(9)
line.recv(100)  # "stop"
"""


def stand_ins(mode: str, monkeypatch, processes: int = 2, runtime: float = 60) -> Supervisor:
    """A supervisor for this process over children that are tiny scripts speaking the tether's protocol.

    ``runtime`` only bounds a test that goes wrong.
    """
    monkeypatch.setenv("STAND_IN", mode)
    monkeypatch.setattr(supervisor_module, "BACKOFF_FIRST", 0.05)
    config = WorkerConfig(queues=["w-ok"], max_runtime=runtime)
    return Supervisor(config, PoolConfig(processes=processes), command=[sys.executable, "-c", STAND_IN])


def test_children_that_cannot_start_stop_the_pool_with_status_1(monkeypatch, caplog):
    pool = stand_ins("fail", monkeypatch)
    assert pool.run() == ExitStatus.ERROR
    assert pool.counts["started"] in (supervisor_module.START_FAILURES, supervisor_module.START_FAILURES + 1)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "exited before they were ready" in errors[0].getMessage()
    assert not Worker.objects.exists()


def test_children_that_die_are_restarted_with_a_backoff_that_doubles(monkeypatch, caplog):
    pool = stand_ins("die", monkeypatch, processes=1)
    died = pool._died

    def stop_after_four(child, how):
        died(child, how)
        if pool.counts["restarted"] == 4:
            pool.begin_stop("enough")

    monkeypatch.setattr(pool, "_died", stop_after_four)
    assert pool.run() == ExitStatus.OK
    waits = [re.search(r"restarting it in (\S+)s$", r.getMessage()) for r in caplog.records]
    assert [float(w.group(1)) for w in waits if w] == [0.05, 0.1, 0.2, 0.4]


def test_a_stopped_pool_stops_its_children_and_removes_its_row(monkeypatch):
    pool = stand_ins("serve", monkeypatch, runtime=1.0)
    assert pool.run() == ExitStatus.OK
    assert (pool.counts["started"], pool.counts["restarted"], pool.why) == (2, 0, "max runtime reached")
    assert not Worker.objects.exists()


def test_the_row_of_a_child_seen_dying_is_stale_at_once_for_the_reaper(settings):
    pool = Supervisor(WorkerConfig(queues=["w-ok"]), PoolConfig(processes=2), command=["unused"])
    Worker.objects.register("child-x", ["w-ok"], 1, supervisor=pool.name)
    Worker.objects.register("child-y", ["w-ok"], 1, supervisor=pool.name)
    stale_after = settings.DBQUEUE.get("WORKER_STALE_AFTER", 8.0)
    assert not Worker.objects.stale(stale_after).exists()
    pool._dead_rows.put("child-x")
    pool._beat()  # the monitor thread's beat: its own row (registered again: it was not), and the dead
    assert list(Worker.objects.stale(stale_after).values_list("name", flat=True)) == ["child-x"]
    assert Worker.objects.get(name=pool.name).pool["target"] == 2


def test_queuestats_shows_each_pool_with_its_children_under_it():
    rows = Worker.objects
    rows.register("pool-a", ["w-ok"], 2, pool={"processes": 2, "target": 2, "restarted": 1, "decision": ""})
    rows.register("child-2", ["w-ok"], 2, supervisor="pool-a")
    rows.register("alone", ["w-ok"], 1)
    rows.register("child-1", ["w-ok"], 2, supervisor="pool-a")
    out = StringIO()
    call_command("queuestats", stdout=out)
    lines = out.getvalue().split("Workers (4)\n")[1].splitlines()
    assert lines[0].startswith("  alone  queues w-ok")
    assert lines[1].startswith("  pool-a  pool of 2 processes (target 2), 1 restarted  queues w-ok")
    assert lines[2].startswith("    child-1  queues w-ok") and lines[3].startswith("    child-2  queues w-ok")
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    workers = json.loads(out.getvalue())["workers"]
    assert [(w["name"], w["supervisor"], w["depth"]) for w in workers][1:] == [
        ("pool-a", "", 0),
        ("child-1", "pool-a", 1),
        ("child-2", "pool-a", 1),
    ]


# --- real pools ------------------------------------------------------------------


@pytest.mark.slow
def test_a_pool_runs_children_that_name_their_supervisor_and_stops_gracefully(pools, tmp_path):
    marks = tmp_path / "marks"
    pool = pools.start("w-ok", "w-sleep", "--processes", 2, "--concurrency", 2, marks=marks)
    row, children = wait_for_children(pool.pid, 2)
    assert row.pool["processes"] == 2 and row.pool["target"] == 2
    assert {child.concurrency for child in children} == {2}
    assert len({child.pid for child in children} | {pool.pid}) == 3
    ids = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(20)])]
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=ids).count() == 20, what="the messages to be acked")
    assert {pid for _, _, pid in read_marks(marks)} <= {child.pid for child in children}
    slow = django_dbqueue.enqueue("w-sleep", {"sleep": 3})
    wait_for(lambda: ("start", slow.pk) in {(e, pk) for e, pk, _ in read_marks(marks)}, what="the handler to start")
    pids = pool_children(pool.pid)
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert ArchivedMessage.objects.get(message_id=slow.pk).outcome == Outcome.ACKED  # within the grace
    assert not Worker.objects.exists()
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", "queues"])
def test_one_pool_serves_queues_on_two_databases_with_a_child_for_each(pools, tmp_path):
    marks = tmp_path / "marks"
    pool = pools.start("w-ok", "elsewhere", "--processes", 2, "--reap", "-v", 2, marks=marks)
    _, children = wait_for_children(pool.pid, 2)
    by_queue = {tuple(child.queues): child for child in children}
    assert set(by_queue) == {("w-ok",), ("elsewhere",)}
    here = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(10)])]
    there = [m.pk for m in django_dbqueue.enqueue_many("elsewhere", [{"n": n} for n in range(10)])]
    assert Message.objects.using("queues").filter(pk__in=there).count() == 10
    done = ArchivedMessage.objects.filter(message_id__in=here + there, outcome=Outcome.ACKED)
    wait_for(lambda: done.count() == 20, what="the messages of both databases to be acked")
    ran = {pk: pid for event, pk, pid in read_marks(marks) if event == "done"}
    assert {ran[pk] for pk in here} == {by_queue[("w-ok",)].pid}
    assert {ran[pk] for pk in there} == {by_queue[("elsewhere",)].pid}
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert "(database default)" in output and "(database queues)" in output
    assert output.count("reaper on") == 2  # the first child of each database reaps it
    assert not Worker.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", "faulty"])
def test_a_database_that_goes_away_stalls_only_the_children_serving_it(fault_proxy, pools, tmp_path):
    """The queue "cut-off" lives on the alias "faulty", whose connections (the children's too) go through
    a proxy; stopping the proxy takes that server away, connections cut and new ones refused."""
    marks = tmp_path / "marks"
    port = str(fault_proxy.port)
    pool = pools.start("w-ok", "cut-off", "--processes", 2, "-v", 2, marks=marks, DBQUEUE_TEST_FAULTY_PORT=port)
    wait_for_children(pool.pid, 2)
    before = [m.pk for m in django_dbqueue.enqueue_many("cut-off", [{"n": n} for n in range(5)])]
    acked = ArchivedMessage.objects.filter(outcome=Outcome.ACKED)
    wait_for(lambda: acked.filter(message_id__in=before).count() == 5, what="the cut-off queue's messages")
    fault_proxy.stop()
    here = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(20)])]
    wait_for(lambda: acked.filter(message_id__in=here).count() == 20, timeout=60, what="the other queue's messages")
    assert pool.poll() is None  # the pool rides over it
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool, timeout=120)
    assert status == ExitStatus.OK, output
    assert "could not remove its row on 'faulty'" in output  # told, and left to that database's reaper


@pytest.mark.slow
def test_a_child_killed_mid_message_is_replaced_and_its_message_runs_again(pools, tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-slow", {"sleep": 600})  # the first attempt hangs; a rerun is quick
    pool = pools.start("w-slow", "w-ok", "--processes", 2, "--reap", "--visibility-timeout", 600, marks=marks)
    victim = wait_for(
        lambda: next((pid for event, pk, pid in read_marks(marks) if (event, pk) == ("start", slow.pk)), None),
        timeout=90,
        what="the slow handler to start",
    )
    wait_for_children(pool.pid, 2)
    # The victim runs the slow one (one thread): the other child takes these, and only it.
    others = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(20)])]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(
        lambda: ArchivedMessage.objects.filter(message_id=slow.pk, outcome=Outcome.ACKED).exists(),
        timeout=90,
        what="the killed child's message to run again",
    )
    # Far within its 600 s lease: the supervisor saw the child die and marked its row stale at once,
    # and the reaper's next pass gave its message back.
    assert time.monotonic() - killed_at < 60
    _, children = wait_for_children(pool.pid, 2)
    assert victim not in {child.pid for child in children}
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=others).count() == 20, what="the others")
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert re.search(rf"child \d \(pid {victim}\) died \(killed by SIGKILL\); restarting it in 1s", output)
    assert ArchivedMessage.objects.get(message_id=slow.pk).attempts == 2
    done = Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
    assert done == Counter([slow.pk, *others])  # nothing lost, nothing twice
    assert [pid for event, pk, pid in read_marks(marks) if (event, pk) == ("done", slow.pk)] != [victim]
    assert not Worker.objects.exists()


@pytest.mark.slow
def test_an_import_error_in_the_children_stops_the_pool_with_status_1_and_one_line(pools):
    pool = pools.start("w-ok", "--processes", 3, DBQUEUE_TEST_BROKEN_CHILD="1")
    status, output = pools.finish(pool)
    assert status == ExitStatus.ERROR, output
    errors = [line for line in output.splitlines() if "exited before they were ready" in line]
    assert len(errors) == 1 and "the pool stops" in errors[0]
    # A few starts, not a storm: three failures in a row stop the pool (the first to fail may have been
    # started again a second later, before the third failed on a slow machine).
    assert output.count("No module named 'tests.testapp.no_such_module'") in (3, 4)
    assert not Worker.objects.exists()


@pytest.mark.slow
def test_exec_mode_runs_in_every_child_with_its_timeout(pools, tmp_path):
    marks = tmp_path / "marks"
    ids = [m.pk for m in django_dbqueue.enqueue_many("w-exec", [{"text": str(n)} for n in range(30)])]
    hung = django_dbqueue.enqueue("w-exec", {"sleep": 60}, max_attempts=1)
    command = f"{sys.executable} {ROOT / 'tests' / 'support' / 'exec_consumer.py'} {marks}"
    pool = pools.start("w-exec", "--processes", 2, "--until-empty", "--exec", command, "--exec-timeout", 2, "-v", 2)
    status, output = pools.finish(pool, timeout=120)
    assert status == ExitStatus.OK, output
    rows = ArchivedMessage.objects.filter(message_id__in=ids)
    assert rows.count() == 30 and set(rows.values_list("outcome", flat=True)) == {Outcome.ACKED}
    # Each ran its command once, in a child (the supervisor runs no handler); the hung one was killed asleep.
    ran = Counter(int(line.split()[0]) for line in marks.read_text().splitlines())
    assert ran == Counter(ids)
    supervisor = re.search(r"pool (\S+) exits", output).group(1)
    assert supervisor not in set(rows.values_list("finished_by", flat=True))
    assert output.count(f"exec: {command}") == 2  # each child's banner names the command
    dead = ArchivedMessage.objects.get(message_id=hung.pk)  # the children got --exec-timeout too
    assert dead.outcome == Outcome.DEAD and "ran longer than 2s and was killed" in dead.last_error


# Children of the tests of replacements take this long more to start: see largest_gap.
SLOW_START = 2.5


def largest_gap(ids: list[int]) -> float:
    """The longest time between two of ``ids`` finishing, in seconds.

    While one child replaces another, the pool's capacity would drop to
    nothing for as long as the new child takes to start (at least
    ``SLOW_START`` seconds, with DBQUEUE_TEST_SLOW_CHILD_START) if the old one
    stopped first: a shorter gap shows that messages kept finishing.
    """
    finished = sorted(ArchivedMessage.objects.filter(message_id__in=ids).values_list("finished_at", flat=True))
    return max((b - a).total_seconds() for a, b in itertools.pairwise(finished))


@pytest.mark.slow
def test_sighup_replaces_every_child_one_after_another_during_a_drain(pools, tmp_path):
    marks = tmp_path / "marks"
    ids = [m.pk for m in django_dbqueue.enqueue_many("w-sleep", [{"sleep": 0.05}] * 100)]
    pool = pools.start("w-sleep", "--processes", 2, marks=marks, DBQUEUE_TEST_SLOW_CHILD_START=str(SLOW_START))
    _, before = wait_for_children(pool.pid, 2)
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=ids).count() >= 20, what="the drain to start")
    pool.send_signal(signal.SIGHUP)
    old = {child.pid for child in before}

    def replaced():
        if Message.objects.filter(queue="w-sleep").count() < 50:  # a backlog all along, however slow the restart
            ids.extend(m.pk for m in django_dbqueue.enqueue_many("w-sleep", [{"sleep": 0.05}] * 50))
        rows = children_rows(before[0].supervisor)
        return len(rows) == 2 and not old & {row.pid for row in rows} and not any(map(alive, old))

    wait_for(replaced, timeout=120, interval=0.2, what="both children to be replaced")
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=ids).count() == len(ids), timeout=120, what="drain")
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    done = Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
    assert done == Counter(ids)  # nothing lost, nothing twice
    assert {pid for _, _, pid in read_marks(marks)} > old  # the old children worked, and the new ones
    assert largest_gap(ids) < SLOW_START  # throughput never at zero


@pytest.mark.slow
def test_a_supervisor_killed_with_sigkill_leaves_no_orphans(pools, tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-sleep", {"sleep": 3})
    pool = pools.start("w-sleep", "--processes", 2, marks=marks)
    row, children = wait_for_children(pool.pid, 2)
    wait_for(lambda: read_marks(marks), what="the handler to start")
    pids = pool_children(pool.pid)
    assert sorted(pids) == sorted(child.pid for child in children)
    pool.kill()
    pool.wait(timeout=10)
    # Each child reads the end of its socket, stops gracefully (the running handler finishes) and exits.
    wait_for(lambda: not any(map(alive, pids)), timeout=60, what="the orphaned children to exit")
    assert ArchivedMessage.objects.get(message_id=slow.pk).outcome == Outcome.ACKED
    assert list(Worker.objects.values_list("name", flat=True)) == [row.name]  # the reaper takes the supervisor's
    assert "its supervisor" in pools.output(pool) and "is gone" in pools.output(pool)


@pytest.mark.slow
def test_a_second_sigterm_stops_the_pool_at_once(pools, tmp_path):
    marks = tmp_path / "marks"
    slow = django_dbqueue.enqueue("w-sleep", {"sleep": 60})
    pool = pools.start("w-sleep", "--processes", 2, marks=marks)
    wait_for(lambda: read_marks(marks), timeout=90, what="the handler to start")
    pids = pool_children(pool.pid)
    pool.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool, timeout=30)
    assert status == ExitStatus.FORCED, output
    wait_for(lambda: not any(map(alive, pids)), timeout=10, what="the children to be gone")
    assert not ArchivedMessage.objects.filter(message_id=slow.pk).exists()  # its lease will expire


@pytest.mark.slow
def test_sigttin_adds_a_child_and_sigttou_removes_one(pools):
    pool = pools.start("w-ok", "--processes", 1, "-v", 2)
    wait_for_children(pool.pid, 1)
    pool.send_signal(signal.SIGTTIN)
    wait_for_children(pool.pid, 2)
    wait_for(lambda: supervisor_row(pool.pid).pool["target"] == 2, what="the row to say so")
    pool.send_signal(signal.SIGTTOU)
    wait_for_children(pool.pid, 1)
    pool.send_signal(signal.SIGTTOU)  # never fewer than one
    wait_for(lambda: "already at one child" in pools.output(pool), what="the pool to say so")
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert supervisor_row(pool.pid) is None


@pytest.mark.slow
def test_until_empty_ends_the_pool_and_the_reaper_and_schedules_run_once(pools):
    ids = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(40)])]
    tick = json.dumps({"pool-tick": {"EVERY": 3600, "QUEUE": "w-sleep"}})
    pool = pools.start("w-ok", "--processes", 2, "--until-empty", "--reap", "-v", 2, DBQUEUE_TEST_SCHEDULES=tick)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert ArchivedMessage.objects.filter(message_id__in=ids, outcome=Outcome.ACKED).count() == 40
    banners = re.findall(r"concurrency  1, batch size adaptive \(1 to 20\), schedules (\w+).*, reaper (\w+)", output)
    assert sorted(banners) == [("off", "off"), ("on", "on")]
    assert "every child found the queues empty" in output
    assert not Worker.objects.exists()


@pytest.mark.slow
def test_children_are_recycled_at_their_limits_while_messages_keep_flowing(pools, tmp_path):
    marks = tmp_path / "marks"
    plain = [m.pk for m in django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(12)])]
    limits = ("--max-messages-per-child", 10, "--max-memory-per-child", 90)
    slow_start = {"DBQUEUE_TEST_SLOW_CHILD_START": str(SLOW_START)}
    pool = pools.start("w-ok", "w-leak", "--processes", 1, *limits, "-v", 2, marks=marks, **slow_start)
    first = wait_for(lambda: {pid for _, _, pid in read_marks(marks)}, timeout=90, what="the first child at work")
    # The first child passes 10 messages: its replacement takes over before it leaves.
    wait_for(lambda: not any(map(alive, first)), timeout=90, what="the first child to be recycled")
    assert ArchivedMessage.objects.filter(message_id__in=plain).count() == 12
    [second] = [row.pid for row in children_rows(supervisor_row(pool.pid).name)]
    # Each of these keeps 6 MB for good: the second child (some 55 MB at rest) passes 90 MB after six or
    # seven of them, before its 10 messages, and leaks on until its replacement is ready; the backlog lasts.
    leaks: list[int] = []

    def recycled():
        if Message.objects.filter(queue="w-leak").count() < 10:
            leaks.extend(m.pk for m in django_dbqueue.enqueue_many("w-leak", [{"mb": 6, "sleep": 0.2}] * 10))
        return not alive(second)

    wait_for(recycled, timeout=120, interval=0.2, what="the second child to be recycled")
    wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=leaks).count() == len(leaks), what="the rest")
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert re.search(r"is recycled \(1[0-2] messages, at its limit of 10\)", output), output
    assert re.search(r"is recycled \(resident memory \d+ MB, past its limit of 90 MB\)", output), output
    done = Counter(pk for event, pk, _ in read_marks(marks) if event == "done")
    assert done == Counter(plain + leaks)  # nothing lost, nothing twice
    workers = Counter(pid for event, pk, pid in read_marks(marks) if event == "done" and pk in leaks)
    # The second child, then its replacement (which leaks too, and may itself be recycled before the SIGTERM).
    assert second in workers and len(workers) >= 2, workers
    # One process, and never none at work: the replacement was ready before its predecessor stopped.
    assert largest_gap(leaks) < SLOW_START


# --- autoscaling ---------------------------------------------------------------------


def reading(held: int = 0, **waits):
    from django_dbqueue.worker.autoscale import Reading

    return Reading(waits=waits or {"q": None}, held=held)


def test_the_autoscaler_grows_one_child_at_a_time_while_messages_wait():
    from django_dbqueue.worker.autoscale import Autoscaler

    scaler = Autoscaler(1, 3, wait=2.0, idle=30.0)
    assert scaler.decide(reading(q=1.9), size=1, starting=0, per_child=1, now=0) is None  # not long enough
    assert scaler.decide(reading(q=2.5, r=None), size=1, starting=0, per_child=1, now=1) == (
        2,
        "grew to 2: the next message of q has waited 2.5s",
    )
    assert scaler.decide(reading(q=3.5), size=2, starting=1, per_child=1, now=2) is None  # the last is starting
    assert scaler.decide(reading(q=4.0, r=9.0), size=2, starting=0, per_child=1, now=3)[0] == 3
    assert scaler.decide(reading(q=9.0), size=3, starting=0, per_child=1, now=4) is None  # at MAX


def test_the_autoscaler_shrinks_after_an_idle_period_with_a_child_s_capacity_unused():
    from django_dbqueue.worker.autoscale import Autoscaler

    scaler = Autoscaler(1, 3, wait=2.0, idle=30.0)
    assert scaler.decide(reading(held=2), size=3, starting=0, per_child=2, now=0) is None  # the idle clock starts
    assert scaler.decide(reading(held=4), size=3, starting=0, per_child=2, now=29) is None
    assert scaler.decide(reading(held=4), size=3, starting=0, per_child=2, now=31) == (
        2,
        "shrank to 2: one child's capacity unused for 30s",
    )
    assert scaler.decide(reading(held=2), size=2, starting=0, per_child=2, now=50) is None  # a new period
    assert scaler.decide(reading(held=3), size=2, starting=0, per_child=2, now=70) is None  # busy: clock reset
    assert scaler.decide(reading(held=0), size=2, starting=0, per_child=2, now=71) is None
    assert scaler.decide(reading(held=0, q=2.0), size=2, starting=0, per_child=2, now=95)[0] == 3  # a backlog
    assert scaler.decide(reading(held=0), size=3, starting=0, per_child=2, now=96) is None  # starts afresh
    assert scaler.decide(reading(held=0), size=3, starting=0, per_child=2, now=126)[0] == 2
    assert scaler.decide(reading(held=0), size=1, starting=0, per_child=2, now=500) is None  # at MIN


def test_the_backlog_is_read_per_queue_from_the_message_a_claim_would_take_next():
    from datetime import timedelta

    old = django_dbqueue.enqueue("a-q1", {}, priority=5)
    django_dbqueue.enqueue("a-q1", {})  # claimed first (priority 0), and just enqueued
    django_dbqueue.enqueue("a-q2", {}, delay=3600)  # scheduled: nothing waits
    Message.objects.filter(pk=old.pk).update(available_at=old.available_at - timedelta(seconds=60))
    waits = Message.objects.next_waits(["a-q1", "a-q2", "a-q3"])
    assert waits["a-q1"] < 30 and waits["a-q2"] is None and waits["a-q3"] is None
    claimed = Message.objects.claim("a-q1", 1, worker="child-1")
    assert Message.objects.next_waits(["a-q1"])["a-q1"] > 59  # now the old one is next
    assert Message.objects.held_by(["child-1", "child-2"]) == len(claimed) == 1
    assert Message.objects.held_by([]) == 0

    # A FIFO group's next message waits for its elder, which runs: no claim would take it, more processes
    # would not run it sooner.
    first, second = django_dbqueue.enqueue_many("fc-fifo", [{"n": 1}, {"n": 2}], group="g")
    Message.objects.filter(pk__in=[first.pk, second.pk]).update(available_at=first.available_at - timedelta(seconds=60))
    assert Message.objects.next_waits(["fc-fifo"])["fc-fifo"] > 59
    assert [m.pk for m in Message.objects.claim("fc-fifo", 5, worker="child-1")] == [first.pk]
    assert Message.objects.next_waits(["fc-fifo"]) == {"fc-fifo": None}


def test_a_child_s_capacity_counts_its_event_loop_s_slots_when_it_serves_async_handlers():
    """The shrink rule compares what the children hold with all but one child's capacity: a child with async
    handlers holds up to --async-concurrency more, and a pool busy far below that must still shrink."""
    config = WorkerConfig(queues=["w-ok"], concurrency=2, batch_size=3, async_concurrency=50)
    assert Supervisor(config, PoolConfig(processes=2), command=["x"]).per_child == 6
    config = WorkerConfig(queues=["w-ok", "a-sleep"], concurrency=2, batch_size=3, async_concurrency=50)
    assert Supervisor(config, PoolConfig(processes=2), command=["x"]).per_child == 56
    config = WorkerConfig(queues=["a-mixed"], concurrency=2, async_concurrency=50)  # the threads claim it
    assert Supervisor(config, PoolConfig(processes=2), command=["x"]).per_child == 2


def test_autoscale_bounds_are_checked():
    with pytest.raises(CommandError, match="'3,1' is not MIN,MAX"):
        call_command("runqueueworker", "w-ok", "--autoscale", "3,1")
    with pytest.raises(CommandError, match="'0,2' is not MIN,MAX"):
        call_command("runqueueworker", "w-ok", "--autoscale", "0,2")
    with pytest.raises(CommandError, match="not both"):
        call_command("runqueueworker", "w-ok", "--autoscale", "1,2", "--processes", "2")


@pytest.mark.slow
def test_autoscale_grows_to_its_max_under_a_backlog_and_back_to_its_min_when_idle(pools, tmp_path):
    marks = tmp_path / "marks"
    fast = json.dumps({"AUTOSCALE_WAIT": 1.0, "AUTOSCALE_IDLE": 3.0, "AUTOSCALE_INTERVAL": 0.5})
    pool = pools.start("w-sleep", "--autoscale", "1,3", "-v", 2, marks=marks, DBQUEUE_TEST_SETTINGS=fast)
    wait_for_children(pool.pid, 1)
    ids = [m.pk for m in django_dbqueue.enqueue_many("w-sleep", [{"sleep": 1}] * 24)]  # slow messages
    sizes = []

    def drained():
        state = supervisor_row(pool.pid).pool
        sizes.append(state["processes"])
        return ArchivedMessage.objects.filter(message_id__in=ids).count() == len(ids)

    wait_for(drained, timeout=120, interval=0.2, what="the backlog to drain")
    assert max(sizes) == 3
    wait_for_children(pool.pid, 1, timeout=60)  # idle: back to one, a child at a time
    # The supervisor's row says so at its next heartbeat.
    state = wait_for(lambda: (row := supervisor_row(pool.pid).pool)["shrunk"] == 2 and row, what="the row")
    assert (state["processes"], state["min"], state["max"], state["grown"], state["shrunk"]) == (1, 1, 3, 2, 2)
    assert state["decision"] == "shrank to 1: one child's capacity unused for 3s"
    pool.send_signal(signal.SIGTERM)
    status, output = pools.finish(pool)
    assert status == ExitStatus.OK, output
    assert re.findall(r"pool \S+: (grew to \d|shrank to \d)", output) == [
        "grew to 2",
        "grew to 3",
        "shrank to 2",
        "shrank to 1",
    ]
    assert Counter(pk for event, pk, _ in read_marks(marks) if event == "done") == Counter(ids)
