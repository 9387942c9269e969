"""queueanalytics on a real standalone Spark cluster: a master and two workers on 127.0.0.1.

The cluster is started by scripts/spark-standalone from PySpark's own Spark,
on free ports, and stopped at the end whatever happens. queueanalytics runs
as its own process (a Spark driver of its own: the test process already has
a local one) with ``--master spark://...``; the executors read the test
database through the JDBC driver that SPARK_JARS ships to them, and the
figures must be those of local mode: the reference in plain Python that
test_analytics.py checks local mode against, over the same data set.
"""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from django_dbqueue.contrib.spark.conf import spark_jars
from django_dbqueue.contrib.spark.job import AnalyticsJob
from django_dbqueue.models import QueueStat
from tests.support.mariadb_server import free_port
from tests.test_analytics import (
    ACCURACY,
    SINCE,
    UNTIL,
    archive,  # noqa: F401  (the 50,000-row data set, a module fixture)
    assert_matches_reference,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "spark-standalone"
COUNTS = ("enqueued", "acked", "dead", "expired", "retried", "attempts", "top_errors", "throughput")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master and two workers (1 core, 1 GB each); yields (master URL, state directory)."""
    state = tmp_path_factory.mktemp("spark-standalone")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SPARK_STANDALONE_DIR": str(state),
        "SPARK_MASTER_PORT": str(free_port()),
        "SPARK_MASTER_WEBUI_PORT": str(free_port()),
        "SPARK_STANDALONE_TIMEOUT": "120",
    }
    try:
        started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stderr
        status = subprocess.run([SCRIPT, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert "2 worker(s) ALIVE" in status.stdout, status.stdout
        yield started.stdout.strip(), state
    finally:
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
    assert not [pid for pid in state.glob("*.pid")], "stop left pid files behind"


def figures():
    return {(s.hour, s.queue, s.kind): s for s in QueueStat.objects.all()}


# A mark, not a skip inside the test: the cluster fixture would start the cluster (half a minute) first.
@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="SQLite is a file on the driver's host, which executors on other hosts cannot open through JDBC; "
    "the cluster test runs on MariaDB/MySQL and PostgreSQL",
)
def test_queueanalytics_on_a_two_worker_cluster_gives_the_figures_of_local_mode(archive, cluster, spark):  # noqa: F811
    master, state = cluster
    assert master.startswith("spark://127.0.0.1:")
    AnalyticsJob(since=SINCE, until=UNTIL, accuracy=ACCURACY, master="local[2]").run()
    local = figures()
    QueueStat.objects.all().delete()

    env = {
        **os.environ,
        "DBQUEUE_TEST_DATABASE_NAME": connection.settings_dict["NAME"],
        # The executors run this interpreter (it has PySpark); they and the driver talk over loopback.
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    command = [
        sys.executable, "-m", "django", "queueanalytics", f"--master={master}",
        f"--since={SINCE.isoformat()}", f"--until={UNTIL.isoformat()}", f"--accuracy={ACCURACY}",
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "queue/kind/hour figures written" in run.stdout, run.stdout

    assert_matches_reference(archive)
    on_cluster = figures()
    assert set(on_cluster) == set(local)
    for key, stat in local.items():
        for name in COUNTS:
            assert getattr(on_cluster[key], name) == getattr(stat, name), (key, name)
    # The work ran on the cluster's executors, which got the JDBC driver from SPARK_JARS (spark.jars):
    # each executor fetches the jars into its own directory under its worker's work directory.
    driver = {"mysql": "mariadb-java-client.jar", "postgresql": "postgresql.jar"}[connection.vendor]
    assert any(jar.endswith(driver) for jar in spark_jars())
    fetched = glob.glob(str(state / "work-*" / "app-*" / "*" / f"*{driver}"))
    assert len({Path(path).parts[-4] for path in fetched}) == 2, fetched  # in both workers' directories
