"""Progress of the Spark-side work: exportarchive's rows, queueanalytics' stages, enqueue_dataframe's partitions.

Through the commands with an output that claims to be a terminal (progress
shows) and with -v0 (nothing shows), as a user at a shell would run them.
"""

from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command

from django_dbqueue.contrib.spark import enqueue_dataframe
from django_dbqueue.contrib.spark import progress as spark_progress
from django_dbqueue.contrib.spark.synthetic import archive_rows, insert_archive
from django_dbqueue.models import Message, QueueStat
from django_dbqueue.progress import progress_for, progress_to
from tests.support.factories import MessageFactory
from tests.support.terminal import Terminal

# transaction=True: Spark reads through connections of its own, which must see the rows.
pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]

START = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = [f"--since={START.isoformat()}", f"--until={(START + timedelta(hours=3)).isoformat()}"]


@pytest.fixture
def archive():
    assert insert_archive(archive_rows(3000, start=START, hours=3, seed=4)) == 3000
    MessageFactory.create_batch(7, created_at=START + timedelta(minutes=5))
    yield
    QueueStat.objects.all().delete()


@pytest.fixture
def fast_polls(monkeypatch):
    """Look at Spark every 10 ms rather than every 250: a short stage is seen all the same."""
    monkeypatch.setattr(spark_progress, "POLL_EVERY", 0.01)


def test_exportarchive_shows_rows_written_on_a_terminal(archive, tmp_path):
    out = Terminal()
    call_command("exportarchive", f"--out={tmp_path}", "--chunk-size=500", stdout=out)
    assert "writing archive.parquet: [" in out.getvalue()  # the bar, drawn at the start
    lines = out.lines()
    assert lines[0].startswith("writing archive.parquet: 3,000 rows in ")
    assert lines[1].startswith("writing live.parquet: 7 rows in ")
    assert lines[2].startswith("3000 archived rows to ")


def test_exportarchive_with_v0_shows_no_progress(archive, tmp_path):
    out = Terminal()
    call_command("exportarchive", f"--out={tmp_path}", "--chunk-size=500", "-v0", stdout=out)
    assert "writing" not in out.getvalue()
    assert out.getvalue().startswith("3000 archived rows to ")


def test_queueanalytics_shows_spark_stages_on_a_terminal_and_clears_them(archive, spark, fast_polls):
    out = Terminal()
    call_command("queueanalytics", *WINDOW, "--master=local[2]", stdout=out)
    text = out.getvalue()
    assert "Spark stage" in text
    assert " tasks (" in text and " running" in text  # done/total tasks and how many run now
    # The stages' bars are gone by the end: only the command's summary stays.
    assert [line for line in out.lines() if line] == [next(line for line in out.lines() if "rows read" in line)]
    assert QueueStat.objects.exists()


def test_queueanalytics_with_v0_shows_no_stages_and_starts_no_poller(archive, spark, fast_polls):
    import threading

    out = Terminal()
    call_command("queueanalytics", *WINDOW, "--master=local[2]", "-v0", stdout=out)
    assert "Spark stage" not in out.getvalue()
    assert "rows read" in out.getvalue()
    assert not [t for t in threading.enumerate() if t.name == "dbqueue-spark-stages"]


def test_enqueue_dataframe_reports_each_partition_as_it_finishes(spark, fast_polls):
    out = Terminal()
    frame = spark.createDataFrame([(f"k-{i}", i) for i in range(900)], "k STRING, n BIGINT").repartition(3)
    progress = progress_for(out, tty=True, width=200)
    result = enqueue_dataframe(frame, "progress-q", key_col="k", batch_size=100, progress=progress)
    assert result.inserted == 900
    assert "enqueue to progress-q: [" in out.getvalue()
    assert out.lines()[-2].startswith("enqueue to progress-q: 3 partitions in ")
    assert out.lines()[-2].endswith(", 900 rows")
    assert Message.objects.filter(queue="progress-q").count() == 900


def test_enqueue_dataframe_without_progress_or_at_verbosity_0_prints_nothing(spark, capsys):
    frame = spark.createDataFrame([(f"q-{i}", i) for i in range(50)], "k STRING, n BIGINT").repartition(2)
    assert enqueue_dataframe(frame, "progress-q", key_col="k").inserted == 50
    assert capsys.readouterr().out == ""
    out = Terminal()
    again = enqueue_dataframe(frame, "progress-q", key_col="k", progress=progress_to(out, verbosity=0))
    assert (again.inserted, again.existing) == (0, 50)
    assert out.getvalue() == ""
