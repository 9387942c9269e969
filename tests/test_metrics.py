"""Prometheus metrics: the counters fed by signals, the database's gauges, the view, and a real Prometheus."""

import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import django_dbqueue
from django_dbqueue import handlers, metrics
from django_dbqueue.metrics import database, labels
from django_dbqueue.models import ArchivedMessage, Message, Worker
from django_dbqueue.reaper import Reaper
from django_dbqueue.running import process
from django_dbqueue.worker import ExitStatus
from tests.support.processes import ROOT, read_marks, start_command, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def counting():
    """Metrics on in this process for one test; the database's reading is not cached across tests."""
    database._cache.clear()
    database._pool_cache.clear()
    metrics.enable()
    yield
    metrics.disable()
    database._cache.clear()
    database._pool_cache.clear()


def sample(name, **labels_):
    return REGISTRY.get_sample_value(name, labels_) or 0.0


@pytest.fixture
def jobs():
    handlers.handler("m-jobs")(lambda message: 1 / message.payload["n"])
    yield
    handlers.unregister("m-jobs", None)


def test_counters_and_histograms_follow_what_happens(counting, jobs, settings):
    settings.DBQUEUE = {"BACKOFF_BASE": 0}
    before = {
        name: sample(name, queue="m-jobs", kind="k")
        for name in (
            "dbqueue_messages_enqueued_total",
            "dbqueue_messages_acked_total",
            "dbqueue_messages_failed_total",
            "dbqueue_messages_dead_total",
        )
    }
    durations = sample("dbqueue_handler_duration_seconds_count", queue="m-jobs", kind="k", outcome="acked")
    waits = sample("dbqueue_claim_to_start_seconds_count", queue="m-jobs")
    django_dbqueue.enqueue_many("m-jobs", [{"n": 1}, {"n": 2}], kind="k")
    django_dbqueue.enqueue("m-jobs", {"n": 0}, kind="k", max_attempts=2)
    while claimed := Message.objects.claim("m-jobs"):
        process(claimed[0])
    after = {name: sample(name, queue="m-jobs", kind="k") for name in before}
    assert {name: after[name] - before[name] for name in before} == {
        "dbqueue_messages_enqueued_total": 3,
        "dbqueue_messages_acked_total": 2,
        "dbqueue_messages_failed_total": 1,  # the first attempt of n=0, put back
        "dbqueue_messages_dead_total": 1,  # its second
    }
    assert sample("dbqueue_handler_duration_seconds_count", queue="m-jobs", kind="k", outcome="acked") == durations + 2
    assert sample("dbqueue_claim_to_start_seconds_count", queue="m-jobs") == waits + 4
    assert sample("dbqueue_handlers_in_flight", queue="m-jobs") == 0


def test_reaper_actions_are_counted(counting):
    django_dbqueue.enqueue("m-exp", {}, expires_at=django_dbqueue_now_value())
    before = sample("dbqueue_reaper_actions_total", action="expired")
    assert Reaper().run_once().expired == 1
    assert sample("dbqueue_reaper_actions_total", action="expired") == before + 1


def django_dbqueue_now_value():
    from django_dbqueue.db.clock import db_now

    return db_now("default")


def test_nothing_is_counted_unless_enabled(jobs):
    before = sample("dbqueue_messages_enqueued_total", queue="m-jobs", kind="")
    django_dbqueue.enqueue("m-jobs", {"n": 1})
    assert sample("dbqueue_messages_enqueued_total", queue="m-jobs", kind="") == before


def test_the_view_shows_depth_and_oldest_age_from_the_database(client, counting):
    django_dbqueue.enqueue_many("m-view", [{}, {}])
    django_dbqueue.enqueue("m-view", {}, delay=3600)
    Message.objects.filter(queue="m-view").update(available_at=django_dbqueue_now_value().replace(year=2000))
    page = client.get("/metrics")
    assert page.status_code == 200 and page["Content-Type"].startswith("text/plain")
    text = page.content.decode()
    assert 'dbqueue_queue_depth{queue="m-view",state="ready"} 3.0' in text
    age = next(
        line for line in text.splitlines() if line.startswith('dbqueue_oldest_ready_age_seconds{queue="m-view"}')
    )
    assert float(age.split()[-1]) > 20 * 365 * 86400
    # Cached: a new message shows only once the reading is CACHE_SECONDS old.
    django_dbqueue.enqueue("m-view", {})
    assert 'dbqueue_queue_depth{queue="m-view",state="ready"} 3.0' in client.get("/metrics").content.decode()
    database._cache.clear()
    assert 'dbqueue_queue_depth{queue="m-view",state="ready"} 4.0' in client.get("/metrics").content.decode()


def test_the_view_shows_each_pool_s_size_and_events_from_its_supervisor_s_row(client, counting):
    from django_dbqueue.models import Worker

    state = {"processes": 3, "target": 4, "started": 5, "restarted": 1, "recycled": 0, "grown": 3, "shrunk": 1}
    Worker.objects.register("web-1:40:abc", ["m-view"], 2, pool=state)
    Worker.objects.register("web-1:41:def", ["m-view"], 2, supervisor="web-1:40:abc")  # a child: no series
    text = client.get("/metrics").content.decode()
    assert 'dbqueue_pool_processes{pool="web-1:40:abc"} 3.0' in text
    assert 'dbqueue_pool_target_processes{pool="web-1:40:abc"} 4.0' in text
    assert 'dbqueue_pool_events_total{event="grown",pool="web-1:40:abc"} 3.0' in text
    assert 'dbqueue_pool_events_total{event="restarted",pool="web-1:40:abc"} 1.0' in text
    assert "web-1:41:def" not in text


def test_labels_stay_bounded(monkeypatch):
    monkeypatch.setattr(labels, "_seen", set())
    monkeypatch.setattr(labels, "MAX_SERIES", 2)
    assert labels.queue_and_kind("reply.0123abcd", "") == ("reply.*", "")
    assert labels.queue_and_kind("reply.ffff", "") == ("reply.*", "")  # the same series
    assert labels.queue_and_kind("a", "x") == ("a", "x")
    assert labels.queue_and_kind("b", "y") == ("other", "other")
    assert labels.queue_and_kind("a", "x") == ("a", "x")


def test_queuemetrics_refuses_a_bad_port():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--port must be from 1 to 65535, not 0"):
        call_command("queuemetrics", port=0)


def listening_address(port):
    """The local address a socket listening on ``port`` is bound to, from Linux's /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    return None


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from Linux's /proc")
@pytest.mark.parametrize(("args", "address"), [((), "127.0.0.1"), (("--bind", "0.0.0.0"), "0.0.0.0")])
def test_queuemetrics_listens_on_this_host_only_unless_told(args, address):
    port = free_port()
    command = start_command("queuemetrics", "--port", port, *args)
    try:
        line = command.stdout.readline()
        assert line == f"serving metrics on http://{address}:{port}/metrics\n", command.stderr.read()
        assert listening_address(port) == address
        assert http_ok(f"http://127.0.0.1:{port}/metrics")
    finally:
        command.send_signal(signal.SIGTERM)
        command.communicate(timeout=60)


# --- end to end: a real Prometheus server scrapes a worker's metrics and the web view ---


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def promql(port, query):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return [float(r["value"][1]) for r in answer["data"]["result"]]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs the prometheus server binary (Debian package 'prometheus'; scripts/test installs it)",
)
def test_prometheus_scrapes_a_worker_and_the_view(tmp_path):
    multiproc = tmp_path / "multiproc"
    multiproc.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc), "DBQUEUE_TEST_METRICS": "1"}
    django_dbqueue.enqueue_many("w-ok", [{"n": n} for n in range(5)])
    django_dbqueue.enqueue("w-outcomes", {"action": "raise"}, max_attempts=1)
    django_dbqueue.enqueue("w-outcomes", {"action": "reject"})
    django_dbqueue.enqueue_many("w-later", [{}, {}, {}], delay=3600)
    worker = start_worker("w-ok", "w-outcomes", "--until-empty", **env)
    _, err = worker.communicate(timeout=120)
    assert worker.returncode == ExitStatus.OK, err

    worker_port, web_port, prometheus_port = free_port(), free_port(), free_port()
    processes = [
        start_command("queuemetrics", "--port", worker_port, "--addr", "127.0.0.1", **env),
        # The web server shares the workers' directory, as docs/metrics.md's set-up has it.
        start_command("runserver", f"127.0.0.1:{web_port}", "--noreload", **env),
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        f"  - job_name: dbqueue\n    static_configs:\n      - targets: ['127.0.0.1:{worker_port}']\n"
        "  - job_name: web\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{web_port}']\n"
    )
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{worker_port}/metrics"), what="queuemetrics to serve")
        wait_for(lambda: http_ok(f"http://127.0.0.1:{web_port}/metrics"), what="the web view to serve")
        processes.append(start_prometheus(config, tmp_path / "data", prometheus_port))
        wait_for(lambda: http_ok(f"http://127.0.0.1:{prometheus_port}/-/ready"), what="prometheus to start")
        checks = {
            'up{job="dbqueue"}': [1.0],
            'up{job="web"}': [1.0],
            'sum(dbqueue_messages_acked_total{job="dbqueue",queue="w-ok"})': [5.0],
            'sum(dbqueue_messages_dead_total{job="dbqueue",queue="w-outcomes"})': [2.0],
            'sum(dbqueue_handler_duration_seconds_count{job="dbqueue",queue="w-ok"})': [5.0],
            'sum(dbqueue_claim_to_start_seconds_count{job="dbqueue",queue="w-ok"})': [5.0],
            'dbqueue_queue_depth{job="web",queue="w-later",state="scheduled"}': [3.0],
            'dbqueue_queue_depth{job="dbqueue",queue="w-later",state="scheduled"}': [3.0],
            'dbqueue_queue_depth{queue="w-ok",state="ready"}': [],  # finished queues have no series
            # Both expositions read one directory: summed across them, every ack counts twice
            # (docs/metrics.md: scrape one exposition per directory, or keep a query to one job).
            'sum(dbqueue_messages_acked_total{queue="w-ok"})': [10.0],
            'sum by (queue) (dbqueue_messages_acked_total{job="web",queue="w-ok"})': [5.0],
        }

        def all_match():
            return all(promql(prometheus_port, query) == want for query, want in checks.items())

        wait_for(all_match, timeout=90, interval=1, what="prometheus to have scraped the expected values")
        # Every query of the Grafana dashboard runs, and the backlog panel sees the scheduled messages.
        for expr in dashboard_queries():
            promql(prometheus_port, expr)
        assert promql(prometheus_port, 'max by (queue) (dbqueue_queue_depth{queue=~".*",state="scheduled"})') == [3.0]
    finally:
        for p in processes:
            p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.communicate(timeout=30)
            except Exception:
                p.kill()


@pytest.mark.slow
def test_a_pool_is_one_exposition_and_a_killed_child_s_live_gauges_go_with_it(tmp_path, monkeypatch):
    """docs/workers.md, "Metrics": each child writes its own files and queuemetrics adds them up; a child
    killed mid-message cannot remove its live gauge (handlers in flight) itself, so its supervisor does."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from django_dbqueue.metrics.exposition import build_registry

    multiproc, marks = tmp_path / "multiproc", tmp_path / "marks"
    multiproc.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc), "DBQUEUE_TEST_METRICS": "1"}
    hung = django_dbqueue.enqueue("w-sleep", {"sleep": 600})
    pool = start_worker("w-sleep", "--processes", 2, marks=marks, **env)
    try:
        victim = wait_for(
            lambda: next((pid for event, pk, pid in read_marks(marks) if (event, pk) == ("start", hung.pk)), None),
            timeout=90,
            what="the hung handler to start",
        )
        gauge = multiproc / f"gauge_liveall_{victim}.db"
        wait_for(gauge.exists, what="its in-flight gauge")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not gauge.exists(), timeout=30, what="the supervisor to remove the dead child's gauge")
        children = Worker.objects.exclude(supervisor="").exclude(pid=victim)
        wait_for(lambda: children.count() == 2, timeout=90, what="its replacement")
        # 6 s of work for one thread: both children take part.
        ids = [m.pk for m in django_dbqueue.enqueue_many("w-sleep", [{"sleep": 0.3}] * 20)]
        wait_for(lambda: ArchivedMessage.objects.filter(message_id__in=ids).count() == 20, timeout=90, what="acks")
        pool.send_signal(signal.SIGTERM)
        _, err = pool.communicate(timeout=120)
    finally:
        if pool.poll() is None:
            pool.kill()
            pool.communicate(timeout=10)
    assert pool.returncode == ExitStatus.OK, err
    counted = {path.name for path in multiproc.iterdir() if path.name.startswith("counter_")}
    assert len(counted) >= 2, counted  # the children counted in files of their own
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
    text = generate_latest(build_registry()).decode()
    acked = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dbqueue_messages_acked_total" and sample.labels.get("queue") == "w-sleep"
    ]
    assert sum(acked) == 20  # one exposition for the pool: the children's counts added up
    assert "dbqueue_handlers_in_flight{" not in text  # the killed child's running handler does not linger


def dashboard_queries():
    """The PromQL of docs/grafana-dashboard.json, its variables filled in as Grafana would."""
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs
    return [e.replace("$queue", ".*").replace("$__rate_interval", "1m") for e in exprs]


def test_the_dashboard_uses_only_metrics_that_exist():
    from django_dbqueue.metrics import instruments  # noqa: F401  (registers the metric families)

    names = {
        "dbqueue_messages_enqueued_total",
        "dbqueue_messages_acked_total",
        "dbqueue_messages_failed_total",
        "dbqueue_messages_dead_total",
        "dbqueue_handler_duration_seconds_bucket",
        "dbqueue_claim_to_start_seconds_bucket",
        "dbqueue_handlers_in_flight",
        "dbqueue_reaper_actions_total",
        "dbqueue_queue_depth",
        "dbqueue_oldest_ready_age_seconds",
    }
    import re

    used = {name for expr in dashboard_queries() for name in re.findall(r"dbqueue_[a-z_]+", expr)}
    assert used <= names, used - names
    exposed = {m.name for m in REGISTRY.collect()} | {"dbqueue_queue_depth", "dbqueue_oldest_ready_age_seconds"}
    assert {n.removesuffix("_total").removesuffix("_bucket") for n in names} <= exposed


def test_metrics_without_prometheus_client_is_a_check_error(settings, monkeypatch):
    """prometheus_client is installed here, so its absence is simulated at the one place the check looks."""
    from django_dbqueue import checks

    settings.DBQUEUE = {"METRICS": True}
    assert checks.check_metrics() == []
    monkeypatch.setattr(checks, "find_spec", lambda name: None)
    [error] = checks.check_metrics()
    assert error.id == "django_dbqueue.E004" and "prometheus_client is not installed" in error.msg
    assert error.hint.startswith("pip install prometheus_client ")  # installs before the package is on an index


def start_prometheus(config, data, port):
    return subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
