"""Incremental runs on real Spark: queueanalytics --incremental and exportarchive --incremental.

The archive grows in batches, one of them with a row committed late (its
finished_at in an hour an earlier run already computed); after each batch
the incremental figures must equal a full recompute over everything, and the
reference computed in plain Python. The data lake written by exportarchive
--incremental is read back with pyarrow, not Spark, and must hold each row
of the database exactly once, re-runs and a crashed run included.
"""

import os
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import Count, Sum

from django_dbqueue.contrib.spark.export import export_incremental, watermark_name
from django_dbqueue.contrib.spark.incremental import QUEUEANALYTICS, run_incremental
from django_dbqueue.contrib.spark.job import AnalyticsJob
from django_dbqueue.contrib.spark.models import Watermark
from django_dbqueue.contrib.spark.synthetic import archive_rows, insert_archive
from django_dbqueue.models import ArchivedMessage, QueueStat
from tests.support.analytics_reference import reference, within_rank_error
from tests.support.factories import MessageFactory

# transaction=True: Spark reads the rows through its own connections, so they must be committed.
pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]

START = datetime(2026, 3, 1, tzinfo=UTC)
HOURS = 6
END = START + timedelta(hours=HOURS + 1)  # expired messages finish up to 11 minutes after the last creation
ROWS = 20_000
ACCURACY = 10_000
FIELDS = [f.name for f in QueueStat._meta.fields if f.name not in ("id", "computed_at")]


def snapshot():
    return {(s["hour"], s["queue"], s["kind"]): s for s in QueueStat.objects.values(*FIELDS)}


def full_recompute():
    """The figures of one full run over everything so far, leaving QueueStat as it found it."""
    before = snapshot()
    QueueStat.objects.all().delete()
    AnalyticsJob(since=START - timedelta(days=1), until=END + timedelta(days=1), accuracy=ACCURACY).run()
    full = snapshot()
    QueueStat.objects.all().delete()
    QueueStat.objects.bulk_create([QueueStat(**s) for s in before.values()])
    return full


def assert_equals_reference(rows, live):
    expected = reference(rows, live, START - timedelta(days=1), END + timedelta(days=1))
    stats = snapshot()
    assert set(stats) == set(expected)
    for key, want in expected.items():
        for name in ("enqueued", "acked", "dead", "expired", "retried", "attempts", "top_errors"):
            assert stats[key][name] == want[name], (key, name)
        for prefix in ("wait", "processing"):
            for p in (50, 95, 99):
                value = stats[key][f"{prefix}_p{p}"]
                assert (
                    (value is None) if not want[prefix] else within_rank_error(value, want[prefix], p / 100, ACCURACY)
                )


def test_incremental_runs_after_batches_equal_a_full_recompute(spark):
    rows = sorted(archive_rows(ROWS, start=START, hours=HOURS, seed=21), key=lambda r: r.finished_at)
    cut1, cut2 = START + timedelta(hours=3), START + timedelta(hours=4, minutes=30)
    # One message of hour 2 is committed late: after the run that computed hour 2 and saw rows up to 3:00.
    late = next(r for r in reversed(rows) if r.finished_at < cut1 - timedelta(seconds=30))
    assert late.finished_at.hour == 2 and late.finished_at >= cut1 - timedelta(minutes=5)
    batch1 = [r for r in rows if r.finished_at < cut1 and r is not late]
    batch2 = [r for r in rows if cut1 <= r.finished_at < cut2] + [late]
    batch3 = [r for r in rows if r.finished_at >= cut2]
    live = [("orders", "invoice", START + timedelta(hours=5, minutes=i)) for i in range(7)]
    seen = []

    def run():
        result = run_incremental(AnalyticsJob(since=START, until=START, accuracy=ACCURACY, master="local[2]"))
        incremental, full = snapshot(), full_recompute()
        assert set(incremental) == set(full)
        differences = [
            (k, n, incremental[k][n], full[k][n]) for k in full for n in FIELDS if incremental[k][n] != full[k][n]
        ]
        assert not differences, differences[:5]
        assert_equals_reference(seen, live if len(seen) == len(rows) else [])
        return result

    insert_archive(batch1)
    seen += batch1
    first = run()
    assert first.watermark.finished_at == max(r.finished_at for r in batch1)
    assert Watermark.objects.get(name=QUEUEANALYTICS).last_id == first.watermark.id
    hour2 = snapshot()

    insert_archive(batch2)
    seen += batch2
    second = run()
    # Only hours the new rows touched were read again, and the late row changed hour 2's figures.
    assert START + timedelta(hours=2) <= second.job.window.since
    assert second.job.rows_read < len(seen)
    key = (START + timedelta(hours=2), late.queue, late.kind)
    assert snapshot()[key][late.outcome] == hour2[key][late.outcome] + 1

    insert_archive(batch3)
    for queue, kind, created in live:
        MessageFactory(queue=queue, kind=kind, created_at=created)
    seen += batch3
    third = run()
    assert third.watermark.finished_at == rows[-1].finished_at

    # Nothing new: a run recomputes at most the settle margin's hours, and changes nothing.
    before = snapshot()
    run_incremental(AnalyticsJob(since=START, until=START, accuracy=ACCURACY, master="local[2]"))
    assert snapshot() == before


def test_the_command_reports_its_watermark_and_refuses_a_window(spark, capsys):
    with pytest.raises(
        CommandError, match="--incremental reads the database from its watermark on; it takes no --since"
    ):
        call_command("queueanalytics", "--incremental", "--since=2026-01-01")
    with pytest.raises(CommandError, match="invalid non_negative_float value"):
        call_command("queueanalytics", "--incremental", "--settle=-1")
    call_command("queueanalytics", "--incremental", "--master=local[2]")
    assert "nothing new; watermark none (the archive is empty)" in capsys.readouterr().out
    insert_archive(archive_rows(500, start=START, hours=1, seed=3))
    call_command("queueanalytics", "--incremental", "--master=local[2]", "--settle=60")
    out = capsys.readouterr().out
    mark = ArchivedMessage.objects.order_by("-finished_at", "-id").first()
    assert "hours recomputed (2026-03-01 00:00 to 2026-03-01 02:00 UTC): 500 rows read" in out, out
    assert f"watermark {mark.finished_at:%Y-%m-%d %H:%M:%S.%f} UTC, id {mark.id}" in out
    assert QueueStat.objects.aggregate(n=Sum("acked"))["n"] == ArchivedMessage.objects.filter(outcome="acked").count()


# --- the data lake ---------------------------------------------------------------------------------


def read_lake(directory):
    """The lake as pyarrow reads it (hive partitions), not Spark."""
    import pyarrow.dataset as ds

    return ds.dataset(directory, format="parquet", partitioning="hive").to_table()


def assert_lake_equals_database(directory):
    table = read_lake(directory).to_pydict()
    db = ArchivedMessage.objects.aggregate(n=Count("id"), ids=Sum("id"), messages=Sum("message_id"))
    assert len(table["id"]) == db["n"]
    assert len(set(table["id"])) == db["n"], "a row was exported twice"
    assert (sum(table["id"]), sum(table["message_id"])) == (db["ids"], db["messages"])
    by_outcome = dict(ArchivedMessage.objects.values_list("outcome").annotate(Count("id")))
    assert {o: table["outcome"].count(o) for o in set(table["outcome"])} == by_outcome
    # Each row sits in the partition of its finished_at's UTC date.
    for finished_at, day in zip(table["finished_at"], table["finished_date"], strict=True):
        assert finished_at.astimezone(UTC).date().isoformat() == str(day)


def test_exportarchive_incremental_appends_by_day_once_and_survives_a_crash(tmp_path, capsys, monkeypatch, spark):
    lake = tmp_path / "lake"
    # Three days, so that runs touch more than one partition.
    rows = sorted(archive_rows(3_000, start=START, hours=70, seed=4), key=lambda r: r.finished_at)
    first, second = rows[:1_200], rows[1_200:]
    insert_archive(first)
    call_command("exportarchive", "--incremental", f"--out={lake}", "--chunk-size=500")
    out = capsys.readouterr().out
    assert out.startswith("1200 archived rows to ") and "finished_date=2026-03-01/part-start.parquet" in out, out
    assert_lake_equals_database(lake)

    call_command("exportarchive", "--incremental", f"--out={lake}")
    assert "nothing new to export" in capsys.readouterr().out

    insert_archive(second)
    # A crash after the files of the first day are in place, before the watermark moved.
    replace = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(CommandError, match="disk full"):
        call_command("exportarchive", "--incremental", f"--out={lake}", "--chunk-size=700")
    monkeypatch.setattr(os, "replace", replace)
    assert len(read_lake(lake)) > len(first)  # the half-done run left rows behind ...
    call_command("exportarchive", "--incremental", f"--out={lake}", "--chunk-size=700")
    assert_lake_equals_database(lake)  # ... which the re-run replaced, not doubled
    files = sorted(p.relative_to(lake).as_posix() for p in lake.rglob("*") if p.is_file())
    assert not [f for f in files if f.split("/")[-1].startswith(".")], files
    assert {f.split("/")[0] for f in files} == {f"finished_date=2026-03-0{d}" for d in (1, 2, 3)}
    mark = ArchivedMessage.objects.order_by("-finished_at", "-id").first()
    saved = Watermark.objects.get(name=watermark_name(lake))
    assert (saved.finished_at, saved.last_id) == (mark.finished_at, mark.id)
    # queueanalytics reads the lake as it is.
    call_command("queueanalytics", f"--parquet-in={lake}", "--since=2026-02-28", "--until=2026-03-05")
    figures = QueueStat.objects.aggregate(acked=Sum("acked"), dead=Sum("dead"), enqueued=Sum("enqueued"))
    assert figures == {
        "acked": ArchivedMessage.objects.filter(outcome="acked").count(),
        "dead": ArchivedMessage.objects.filter(outcome="dead").count(),
        "enqueued": ArchivedMessage.objects.count(),
    }


def test_export_leaves_rows_within_the_settle_margin_for_the_next_run(tmp_path):
    now = datetime.now(UTC)
    recent = list(archive_rows(200, start=now - timedelta(hours=2), hours=1, seed=5))
    insert_archive(recent)
    lake = tmp_path / "lake"
    assert export_incremental(lake, settle=timedelta(hours=3)).rows == 0
    assert export_incremental(lake, settle=timedelta(0)).rows == 200
    assert_lake_equals_database(lake)


def test_exportarchive_incremental_refuses_a_window(tmp_path):
    with pytest.raises(CommandError, match="--incremental exports from its watermark on; it takes no --since"):
        call_command("exportarchive", "--incremental", f"--out={tmp_path}", "--since=2026-01-01")
