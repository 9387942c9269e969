"""queuebench runs every phase end to end (tiny sizes: this checks it works, not how fast)."""

import json
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_dbqueue.contrib.bench import runner
from django_dbqueue.models import ArchivedMessage, FlowGroup, Message

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_every_phase_runs_and_reports(monkeypatch, capsys):
    # The benchmark's worker processes must reach this test database.
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command(
        "queuebench",
        "--messages=300",
        "--workers=2",
        "--batch-size=5",
        "--rate=50",
        "--latency-seconds=1",
        "--archive-rows=3000",
        "--scheduled=200",
        "--memory-messages=2000",
        "--per-message-messages=100",
        "--peers-messages=200",
        "--peers-concurrency=2",
        "--cpu-messages=40",
        "--json",
    )
    report = json.loads(capsys.readouterr().out)
    phases = {r["phase"].split(" (")[0].split(" p50")[0]: r for r in report["results"]}
    assert set(phases) == {
        "enqueue",
        "enqueue_many",
        "drain",
        "drain_write",
        "per_message",
        "peers",
        "drain_groups",
        "end-to-end latency",
        "claim+ack median, loaded tables",
        "worker RSS growth over 2000 messages",
        "admin archive page, whole table",
        "admin archive page, filtered by queue",
        "cpu_bound",
    }
    for name in ("enqueue", "enqueue_many", "drain", "drain_write", "per_message"):
        assert phases[name]["ours"] > 0 and phases[name]["baseline"] > 0 and phases[name]["ratio"] > 0
    for name in ("enqueue", "enqueue_many"):
        extra = phases[name]["extra"]
        # This process's CPU per message on each side: the producer's own cost, which wall time hides.
        assert extra["cpu_us_per_message"] > 0 and extra["raw_cpu_us_per_message"] > 0 and extra["cpu_ratio"] > 0
    for name in ("drain", "drain_write", "per_message"):
        extra = phases[name]["extra"]
        # CPU per message is reported for both sides, from the worker processes' own accounting.
        assert extra["cpu_ms_per_message"] > 0 and extra["raw_cpu_ms_per_message"] > 0
    assert phases["per_message"]["extra"]["batch_size"] == 1 and phases["per_message"]["extra"]["workers"] == 1
    assert phases["per_message"]["extra"]["messages"] == 100
    assert phases["drain_write"]["extra"]["handler"] == "write"
    # peers: 1 and --workers default workers, the job plain then atomic, against one transaction per message.
    peers = [r for r in report["results"] if r["phase"].startswith("peers")]
    assert [r["extra"]["workers"] for r in peers] == [1, 1, 2, 2]
    assert ["atomic handler" in r["phase"] for r in peers] == [False, True, False, True]
    assert all(r["phase"].endswith("--concurrency 2)") and r["extra"]["concurrency"] == 2 for r in peers)
    for result in peers:
        assert result["ours"] > 0 and result["baseline"] > 0 and result["extra"]["messages"] == 200
        assert result["extra"]["cpu_ms_per_message"] > 0 and result["extra"]["raw_cpu_ms_per_message"] > 0
    groups = phases["drain_groups"]
    # Against our own drain of the same messages in no group, each side's CPU per message reported.
    assert groups["ours"] > 0 and groups["baseline"] > 0 and groups["extra"]["groups"] == 1000
    assert groups["extra"]["grouped_cpu_ms_per_message"] > 0 and groups["extra"]["ungrouped_cpu_ms_per_message"] > 0
    latency = phases["end-to-end latency"]["extra"]
    assert 0 <= latency["p50_ms"] <= latency["p95_ms"] <= latency["p99_ms"]
    memory = phases["worker RSS growth over 2000 messages"]["extra"]
    # The worker reads its own memory after each tenth of the messages, however fast it drains them.
    assert len(memory["rss_by_tenth_mb"]) == 10 and memory["rss_end_mb"] > 0
    for name in ("admin archive page, whole table", "admin archive page, filtered by queue"):
        assert phases[name]["ours"] > 0 and phases[name]["baseline"] > 0
        assert phases[name]["extra"]["archive_rows"] == 3000
    cpu = phases["cpu_bound"]
    # A pool of 2 processes against one process of 4 threads, a CPU-bound handler (no speed asserted here).
    assert cpu["ours"] > 0 and cpu["baseline"] > 0 and cpu["extra"]["messages"] == 40
    assert cpu["extra"]["baseline"] == "one runqueueworker process with --concurrency 4"
    assert report["config"]["vendor"] == connection.vendor
    # It cleans up after itself.
    assert not Message.objects.filter(queue__startswith="queuebench.").exists()
    assert not ArchivedMessage.objects.filter(queue__startswith="queuebench.").exists()
    assert not FlowGroup.objects.filter(queue__startswith="queuebench.").exists()


def test_unknown_phase_is_refused():
    with pytest.raises(CommandError, match="unknown phase"):
        call_command("queuebench", "--phases=drain,warp")


@pytest.mark.parametrize(
    ("option", "bad"), [("--history-rows", "0"), ("--history-rows", "1000000001"), ("--archive-rows", "-1")]
)
def test_a_row_count_out_of_range_is_refused_naming_it(option, bad):
    # Counts of rows go past --messages' bound (a documented run holds 50,000,000), up to a billion.
    with pytest.raises(CommandError, match=f"{option}: invalid row_count value: '{bad}'"):
        call_command("queuebench", "--phases=archive", f"{option}={bad}")


def test_repeat_reports_medians_of_the_runs(capsys):
    call_command("queuebench", "--phases=enqueue,enqueue_many", "--messages=50", "--repeat=3", "--json")
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["runs"] for r in results] == [3, 3]
    for result in results:
        runs = result["extra"]["runs"]
        assert len(runs) == 3 and result["baseline"] > 0
        assert min(r["messages"] for r in runs) == result["extra"]["messages"] == 50
        cpu = sorted(r["cpu_us_per_message"] for r in runs)
        assert result["extra"]["cpu_us_per_message"] == cpu[1] > 0  # the median of the three


def test_the_producer_phases_print_their_cpu_per_message(capsys):
    call_command("queuebench", "--phases=enqueue,enqueue_many", "--messages=20")
    lines = capsys.readouterr().out.splitlines()
    for phase in ("enqueue (one at a time)", "enqueue_many"):
        below = lines[next(i for i, line in enumerate(lines) if line.startswith(phase)) + 1]
        assert re.fullmatch(r" {4}producer CPU [0-9.]+ µs per message \(raw [0-9.]+, [0-9.]+x\)", below), below


def test_the_producer_cpu_is_each_sides_own_and_leaves_the_clean_up_out(monkeypatch):
    """Each side's CPU is read around its own call only: raw's first, the clean-up between them uncounted."""
    clock = {"cpu": 0.0}
    monkeypatch.setattr(runner.time, "process_time", lambda: clock["cpu"])

    def spend(seconds: float):
        return lambda: clock.update(cpu=clock["cpu"] + seconds)

    bench = runner.QueueBench(runner.BenchConfig())
    monkeypatch.setattr(bench, "clean", spend(100.0))  # never part of either side's figure
    result = bench.producing("p", 1000, raw=spend(0.002), ours=spend(0.005))
    assert result.extra["raw_cpu_us_per_message"] == pytest.approx(2.0)
    assert result.extra["cpu_us_per_message"] == pytest.approx(5.0)
    assert result.extra["cpu_ratio"] == pytest.approx(2.5)


def test_soak_drains_every_message_once_and_reports_tenths(monkeypatch, capsys):
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command("queuebench", "--phases=soak", "--soak-messages=400", "--workers=2", "--batch-size=5", "--json")
    [result] = json.loads(capsys.readouterr().out)["results"]
    extra = result["extra"]
    assert result["phase"] == "soak (400 messages)" and result["ours"] > 0
    assert extra["drained"] == extra["drained_distinct"] == 400
    assert len(extra["rate_per_tenth"]) == 10 and all(rate > 0 for rate in extra["rate_per_tenth"])
    assert extra["last_to_first"] > 0
    assert len(extra["claim_ms_per_tenth"]) == 10 and all(ms is not None for ms in extra["claim_ms_per_tenth"])
    assert set(extra["sizes"]) == {"before", "after_drain", "after_reaper"}
    for size in extra["sizes"].values():
        assert {"table_bytes", "index_bytes"} <= set(size)
        if connection.vendor != "sqlite":
            assert size["table_bytes"] >= 0 and size["index_bytes"] >= 0
    assert not Message.objects.filter(queue__startswith="queuebench.").exists()


def test_fairness_and_sigkill_measure_the_default_against_fixed_batches(monkeypatch, capsys, settings):
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    # The phase waits WORKER_STALE_AFTER for the reaper to take the killed worker for dead.
    settings.DBQUEUE = {**settings.DBQUEUE, "HEARTBEAT_INTERVAL": 0.4, "WORKER_STALE_AFTER": 1}
    call_command(
        "queuebench", "--phases=fairness,sigkill", "--messages=150", "--workers=2", "--fairness-messages=100", "--json"
    )
    fairness, sigkill = json.loads(capsys.readouterr().out)["results"]
    assert fairness["phase"].startswith("fairness") and fairness["extra"]["messages"] == 100
    for label in ("adaptive", "batch 1", "batch 20"):
        run = fairness["extra"][label]
        # A 2 s job is among them: no drain is shorter; a short job is held for no longer than the drain.
        assert run["seconds"] >= 2 and 0 <= run["short_held_p99_ms"] <= run["short_held_max_ms"]
        assert run["short_held_max_ms"] <= run["seconds"] * 1000 and 0 <= run["short_held_over_1s"] <= 99
        assert run["short_only_per_second"] > 0
    assert sigkill["phase"].startswith("sigkill") and sigkill["extra"]["messages"] == 150
    for label in ("adaptive", "batch 1", "atomic"):
        counts = sigkill["extra"][label]
        # What ran twice or lost an attempt was held by the killed worker; nothing else (each drain checked all).
        assert counts["ran_twice"] >= 0 and counts["attempt_lost_unrun"] >= 0
        assert counts["ran_twice"] + counts["attempt_lost_unrun"] <= counts["held_at_kill"]
    # An atomic job's row is written with its ack: the killed transaction took its rows with it.
    assert sigkill["extra"]["atomic"]["ran_twice"] == 0
    assert not Message.objects.filter(queue__startswith="queuebench.").exists()


def test_idle_reports_the_cpu_share_of_one_idle_default_worker(monkeypatch, capsys):
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command("queuebench", "--phases=idle", "--idle-seconds=1", "--json")
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert result["phase"] == "idle worker CPU" and result["unit"] == "% of a core"
    assert result["ours"] >= 0 and result["extra"]["wall_seconds"] >= 1


def test_soak_and_idle_are_left_out_unless_asked_for():
    from django_dbqueue.contrib.bench.runner import DEFAULT_PHASES, PHASES

    opt_in = {"soak", "idle", "async_io"}
    assert opt_in <= set(PHASES) and not opt_in & set(DEFAULT_PHASES)


def test_async_io_drains_with_async_handlers_threads_and_a_pool(monkeypatch, capsys):
    """Three real runqueueworker runs over the same messages (no speed asserted here)."""
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command("queuebench", "--phases=async_io", "--io-messages=40", "--json")
    [result] = json.loads(capsys.readouterr().out)["results"]
    extra = result["extra"]
    assert result["phase"] == "async_io (--async-concurrency 500)" and result["unit"] == "messages/s"
    assert result["ours"] == extra["async_rate"] > 0 and result["baseline"] == extra["threads_rate"] > 0
    assert extra["pool_rate"] > 0 and extra["messages"] == 40
    assert extra["async_rss_mb"] > 0 and extra["threads_rss_mb"] > 0 and extra["pool_rss_mb"] > 0
    assert not ArchivedMessage.objects.filter(queue__startswith="queuebench.").exists()


@pytest.mark.django_db
def test_the_cpu_bound_handler_is_registered_only_where_the_phase_asks(monkeypatch):
    """The bench app is installed here, yet no worker of this project serves queuebench.cpu unless started by it."""
    from django.apps import apps

    from django_dbqueue import handlers
    from django_dbqueue.contrib.bench.apps import CPU_HANDLER_ENVIRONMENT
    from django_dbqueue.contrib.bench.cpu import QUEUE, burn, rounds_for

    assert (QUEUE, None) not in handlers.registered()
    monkeypatch.setenv(CPU_HANDLER_ENVIRONMENT, "1")
    try:
        apps.get_app_config("dbqueue_bench").ready()
        assert (QUEUE, None) in handlers.registered()
    finally:
        handlers.unregister(QUEUE, None)
    assert rounds_for(5) > 0 and burn(10) == sum(n * n % 7 for n in range(10))


def test_workflows_drains_a_chain_and_a_fan_out_against_plain_messages(monkeypatch, capsys):
    from django_dbqueue.models import WorkflowRun

    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command("queuebench", "--phases=workflows", "--messages=60", "--workers=2", "--batch-size=5", "--json")
    results = {r["phase"].split(" (")[0]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(results) == {"workflow chain", "workflow fan-out/fan-in", "workflow join wait p99"}
    joins = results.pop("workflow join wait p99")
    assert joins["unit"] == "ms" and joins["extra"]["joins"] == 60  # one wait per small fan-in, measured
    assert 0 <= joins["extra"]["p50_ms"] <= joins["extra"]["p99_ms"] == joins["ours"]
    for result in results.values():
        assert result["ours"] > 0 and result["baseline"] > 0 and result["unit"] == "steps/s"
    assert results["workflow chain"]["extra"]["steps"] == 60
    fan = results["workflow fan-out/fan-in"]["extra"]
    assert fan["steps"] == 62 and fan["join_wait_ms"] >= 0  # the join claimed after its last parent's ack
    assert fan["root_ms"] >= 0 and fan["parents_rate"] > 0  # the root's ack ended before its children were claimed
    assert fan["parents_ratio"] == pytest.approx(fan["parents_rate"] / results["workflow fan-out/fan-in"]["baseline"])
    # It cleans up after itself, workflows included.
    assert not WorkflowRun.objects.filter(name__startswith="queuebench.").exists()
    assert not ArchivedMessage.objects.filter(queue__startswith="queuebench.").exists()


def test_the_archive_phase_drops_partitions_against_deleting_rows(monkeypatch, capsys):
    """Both layouts remove the same rows; the partitioned one deletes none row by row; the archive is left as found."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no partitions: the phase says so and measures nothing")
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command(
        "queuebench",
        "--phases=archive",
        "--history-rows=6000",
        "--history-days=6",
        "--messages=200",
        "--workers=2",
        "--json",
    )
    report = json.loads(capsys.readouterr().out)
    retention, dropping, deleting = report["results"]
    assert retention["phase"] == "archive retention: drop vs DELETE (6,000 rows, 6 days, keep 3)"
    delete, drop = retention["extra"]["delete"], retention["extra"]["drop"]
    assert delete["rows"] == drop["rows"] == 6000
    assert delete["rows_removed"] == drop["rows_removed"] == delete["rows_deleted"] >= 2000
    assert drop["rows_deleted"] == 0 and drop["partitions_dropped"] >= 2 and delete["partitions_dropped"] == 0
    assert retention["ours"] > 0 and retention["baseline"] > 0
    assert delete["amid_acks"] and drop["amid_acks"]  # each pass met the drain's acks, not its clean-up
    assert dropping["ours"] > 0 and dropping["baseline"] > 0 and deleting["ours"] > 0
    garbage = "dead_tuples_after" if connection.vendor == "postgresql" else "innodb_history_list_length_after"
    assert delete[garbage] is not None and delete["bytes_before"] > 0
    from django_dbqueue.models.partitions import ArchiveLayout

    assert not ArchiveLayout().partitioned()
    assert not ArchivedMessage.objects.filter(queue__startswith="queuebench").exists()


def test_the_archive_phase_repeated_prints_each_runs_figures(monkeypatch, capsys):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no partitions: the phase says so and measures nothing")
    monkeypatch.setenv("DBQUEUE_TEST_DATABASE_NAME", str(connection.settings_dict["NAME"]))
    call_command(
        "queuebench",
        "--phases=archive",
        "--history-rows=600",
        "--history-days=4",
        "--messages=50",
        "--workers=2",
        "--repeat=2",
    )
    out = capsys.readouterr().out
    assert out.count("    drop: pass ") == 2 and out.count("    delete: pass ") == 2, out


def test_the_clean_up_takes_exactly_the_benchmarks_queues():
    from django_dbqueue.contrib.bench.rawsql import named_from
    from tests.support.factories import ArchivedMessageFactory

    names = ["queuebench.drain", "queuebench./x", "queuebench.", "QUEUEBENCH.drain", "queuebenchx", "queuebench", "a"]
    for name in names:
        ArchivedMessageFactory(queue=name)
    found = named_from(ArchivedMessage.objects.all(), "queuebench.")
    expected = ["queuebench.", "queuebench./x", "queuebench.drain"]
    if connection.vendor == "sqlite":  # Django's startswith is SQLite's LIKE there, blind to ASCII case
        expected.insert(0, "QUEUEBENCH.drain")
    assert sorted(found.values_list("queue", flat=True)) == expected
    if connection.vendor == "mysql":  # the queue's indexes can serve it (a LIKE BINARY alone has no possible key)
        assert "dbqueue_arc_queue" in found.explain()


def test_a_drained_message_whose_attempt_failed_on_weather_is_ready_again_at_once():
    """Fault: an atomic handler's transaction deadlocked, the attempt failed. In the benchmark's drain
    queues the retry is ready at once, so --until-empty workers do not stop one message short."""
    import django_dbqueue
    from django_dbqueue.contrib.bench.runner import GROUPS_QUEUE, PREFIX, bench_queues_on

    for queue in (PREFIX + "drain", GROUPS_QUEUE):
        with bench_queues_on("default"):
            django_dbqueue.enqueue(queue, {})
            (message,) = django_dbqueue.claim(queue, 1)
            assert message.fail("(1213, 'Deadlock found when trying to get lock')")
            (again,) = django_dbqueue.claim(queue, 1)
            assert again.pk == message.pk and again.attempts == 2
            assert again.ack()
