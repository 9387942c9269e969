"""queueanalytics --bench-rows runs end to end (tiny sizes: this checks it works, not how fast)."""

import re

import pytest
from django.core.management import call_command

from django_dbqueue.models import ArchivedMessage, QueueStat

# transaction=True: Spark reads the benchmark's rows through its own connections.
pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def test_the_benchmark_times_every_run_and_cleans_up(spark, capsys):
    ArchivedMessage.objects.create(
        message_id=1, queue="kept", payload={}, created_at="2026-01-01T00:00Z", first_available_at="2026-01-01T00:00Z",
        finished_at="2026-01-01T00:01Z", outcome="acked",
    )  # fmt: skip
    call_command("queueanalytics", "--bench-rows=3000", "--repeat=2", "--master=local[2]")
    out = capsys.readouterr().out
    match = re.search(
        r"3000 rows \(filled in \d+ s\); runs: ([\d.]+), ([\d.]+) s; median ([\d.]+) s = ([\d,]+) rows/s", out
    )
    assert match, out
    first, second, median = map(float, match.groups()[:3])
    assert median == pytest.approx((first + second) / 2, abs=0.06)
    assert int(match.group(4).replace(",", "")) > 0
    # Its rows and figures are gone; other rows are not touched.
    assert list(ArchivedMessage.objects.values_list("queue", flat=True)) == ["kept"]
    assert not QueueStat.objects.exists()


def test_the_incremental_benchmark_keeps_its_archive_on_request_and_needs_one_of_its_own(spark, capsys):
    from django.core.management.base import CommandError

    from django_dbqueue.contrib.spark.models import Watermark

    call_command(
        "queueanalytics", "--bench-rows=2000", "--repeat=2", "--bench-incremental=300", "--bench-keep",
        "--master=local[2]",
    )  # fmt: skip
    out = capsys.readouterr().out
    match = re.search(
        r"2000 rows \(filled in \d+ s\), 300 new before each incremental run; runs: [\d.]+, [\d.]+ s; "
        r"median [\d.]+ s; rows read: (\d+), (\d+); hours recomputed: (\d+), (\d+)",
        out,
    )
    assert match, out
    # Each run read the new rows and the archive's last hours (the settle margin), far from all of it.
    assert all(300 <= int(n) < 1000 for n in match.groups()[:2]), out
    # The new rows and the benchmark's watermark are gone; the kept archive is reused, then removed.
    assert ArchivedMessage.objects.count() == 2000
    assert not Watermark.objects.exists()
    call_command("queueanalytics", "--bench-rows=2000", "--repeat=1", "--master=local[2]")
    assert "2000 rows (kept from an earlier run); runs:" in capsys.readouterr().out
    assert not ArchivedMessage.objects.exists()

    ArchivedMessage.objects.create(
        message_id=1, queue="kept", payload={}, created_at="2026-01-01T00:00Z", first_available_at="2026-01-01T00:00Z",
        finished_at="2026-01-01T00:01Z", outcome="acked",
    )  # fmt: skip
    with pytest.raises(CommandError, match="holds rows other than the benchmark's; run the incremental benchmark"):
        call_command("queueanalytics", "--bench-rows=100", "--bench-incremental=10", "--master=local[2]")
    with pytest.raises(CommandError, match="--bench-incremental and --bench-keep go with --bench-rows N"):
        call_command("queueanalytics", "--bench-keep")
