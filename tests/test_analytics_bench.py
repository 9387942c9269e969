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
